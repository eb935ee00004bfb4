"""The `llmlab` command line: help without importing torch, bad arguments refused before any model loads, blank
prompts refused, every option documented with its default, and the tour's note on the default model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from llmlab.cli import build_parser

HEAVY = ["torch", "transformers", "ipywidgets", "plotly", "anywidget"]

# Runs `llmlab.cli.main()` with sys.argv[1:] in a fresh interpreter; prints the exit status and the heavy modules
# that got imported, as JSON on the last line of stdout.
_RUN_MAIN = (
    "import json, sys\n"
    "argv = sys.argv[1:]\n"
    "sys.argv = ['llmlab', *argv]\n"
    "import llmlab.cli as c\n"
    "try:\n"
    "    code = c.main()\n"
    "except SystemExit as e:\n"
    "    code = e.code\n"
    f"print(json.dumps({{'code': code, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
)


def run_main(*argv: str):
    """(exit status, heavy modules imported, stdout, stderr) of `llmlab *argv` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _RUN_MAIN, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *out, last = proc.stdout.splitlines()
    result = json.loads(last)
    return result["code"], result["heavy"], "\n".join(out), proc.stderr


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBCOMMANDS = sorted(subparsers(build_parser()))


def test_importing_the_cli_imports_no_heavy_module():
    proc = subprocess.run([sys.executable, "-c", f"import sys, llmlab, llmlab.cli; "
                                                 f"print([m for m in {HEAVY!r} if m in sys.modules])"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], *[[sub, "--help"] for sub in SUBCOMMANDS]], ids=" ".join)
def test_help_imports_no_heavy_module(argv):
    code, heavy, out, _ = run_main(*argv)
    assert code == 0 and "usage: llmlab" in out
    assert heavy == []


def test_the_package_names_stay_available():
    import llmlab

    for name in llmlab.__all__:
        assert getattr(llmlab, name) is not None and name in dir(llmlab)
    assert llmlab.__version__ == "0.1.0"
    assert llmlab.engine.LLM is llmlab.LLM and llmlab.engine.load is llmlab.load  # a submodule, after `import llmlab`
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        llmlab.no_such_name


@pytest.mark.parametrize("argv, message", [
    (["generate", "x", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not a positive whole number: "
                                                 "give 1 or more"),
    (["generate", "x", "--max-new-tokens", "ten"], "argument --max-new-tokens: 'ten' is not a whole number"),
    (["generate", "x", "--temperature", "-1"], "argument --temperature: -1 is not a temperature: give 0 for greedy"),
    (["generate", "x", "--temperature", "nan"], "argument --temperature: nan is not a temperature"),
    (["generate", "x", "--top-k", "0"], "argument --top-k: 0 is not a positive whole number"),
    (["generate", "x", "--top-p", "1.5"], "argument --top-p: 1.5 is outside (0, 1]"),
    (["generate", "x", "--top-p", "0"], "argument --top-p: 0 is outside (0, 1]"),
    (["generate", "x", "--seed", str(2**64)], "argument --seed: 18446744073709551616 is outside the seeds"),
    (["generate", ""], "argument prompt: the prompt '' is empty or only whitespace: give some text to continue"),
    (["generate", "  \n"], "argument prompt: the prompt '  \\n' is empty or only whitespace"),
    (["tour", "--prompt", " "], "argument --prompt: the prompt ' ' is empty or only whitespace"),
    (["tour", "--repeats", "-2"], "argument --repeats: -2 is not a positive whole number"),
    (["tour", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not a positive whole number"),
    (["record", "--duration", "0"], "argument --duration: 0 is not a number of seconds > 0"),
    (["profile", "--batch", "0"], "argument --batch: 0 is not a positive whole number"),
    (["bench", "--time-budget", "-1"], "argument --time-budget: -1 is not a number of seconds >= 0"),
    (["bench", "--no-save", "--out", "x"], "llmlab: error: --no-save writes no file"),
    (["bench", "--steps", ","], "llmlab: error: --steps ',' names no ladder step"),
])
def test_bad_arguments_are_refused_before_torch_is_imported(argv, message):
    code, heavy, out, err = run_main(*argv)
    assert code == 2
    assert message in err and "Traceback" not in err and out == ""
    assert heavy == []  # so no model was loaded either


def test_blank_prompt_is_refused_by_the_api_and_the_model_still_works():
    """The default model's tokenizer adds BOS: "" used to encode to [BOS] and generate 64 tokens from it."""
    import llmlab

    llm = llmlab.load(device="cpu")
    before = llm.generate("The list", max_new_tokens=8).token_ids
    for prompt in ("", " ", "\n\t"):
        with pytest.raises(ValueError, match=r"^the prompt .* is empty or only whitespace: give some text"):
            llm.generate(prompt, max_new_tokens=8)
    assert llm.generate("The list", max_new_tokens=8).token_ids == before
    bos_only = llm.encode("")  # the way to generate from BOS alone, as the message says
    assert len(bos_only) == 1 and llm.generate(bos_only, max_new_tokens=2).n_generated == 2


def test_run_tour_refuses_a_blank_prompt_before_loading(monkeypatch):
    import llmlab.tour

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the prompt was checked")

    monkeypatch.setattr(llmlab.tour.LLM, "load", no_loading)
    with pytest.raises(ValueError, match="empty or only whitespace"):
        llmlab.tour.run_tour(prompt="  ", device="cpu")


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_option_has_help_with_its_default(name):
    parser = subparsers(build_parser())[name]
    assert parser.description
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"llmlab {name} {flag} has no help"
        if action.option_strings:  # an option, not the positional prompt: say what happens without it
            assert "default" in action.help, f"llmlab {name} {flag}: its help does not give the default"
    assert "%(default)" not in parser.format_help()  # every %(default)s expands


def test_tour_help_gives_the_defaults():
    text = subparsers(build_parser())["tour"].format_help()
    for line in ("(default: 'The list')", "(default: 128)", "(default: 3)"):
        assert line in " ".join(text.split()), line


def test_tour_explains_the_default_models_text_only_for_it(tmp_path):
    from tiny_models import model_folder

    from llmlab.tour import run_tour

    lines = []
    run_tour("default", device="cpu", max_new_tokens=2, repeats=1, print_fn=lines.append)
    notes = [line for line in lines if "toy model trained on Python's documentation" in line]
    assert notes == ["(pydoc-llama is a 7.7M-parameter toy model trained on Python's documentation: its text below "
                     "is babble in the style of help() pages; the tour measures speed, not the quality of the text)"]
    assert lines.index(notes[0]) == len(lines) - 2  # just above the sample text

    folder, _ = model_folder(tmp_path / "other")
    lines = []
    run_tour(str(folder), device="cpu", max_new_tokens=2, repeats=1, print_fn=lines.append)
    assert not any("toy model" in line for line in lines)


def test_a_small_model_on_a_cpu_is_timed_on_one_thread(monkeypatch):
    import torch

    from llmlab.measure.timing import SMALL_CPU_MODEL, cpu_threads_for, intra_op_threads
    from llmlab.tour import run_tour

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads_for("cpu", 7.7e6) == 1
    assert cpu_threads_for("cpu", SMALL_CPU_MODEL) is None  # a large model's matrices are worth splitting
    assert cpu_threads_for("cuda", 7.7e6) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads_for("cpu", 7.7e6) is None  # the user's choice wins
    monkeypatch.delenv("OMP_NUM_THREADS")

    before = torch.get_num_threads()
    seen = []
    with intra_op_threads(1):
        seen.append(torch.get_num_threads())
    assert seen == [1] and torch.get_num_threads() == before

    lines = []
    run_tour("default", device="cpu", max_new_tokens=2, repeats=1, print_fn=lines.append)
    assert any("one intra-op thread" in line for line in lines)
    assert torch.get_num_threads() == before
