"""Load and save Hugging Face format checkpoints: config.json + safetensors (single or sharded) + tokenizer.json.

Only safetensors are read — never pickle (`pytorch_model.bin` can run arbitrary code when unpickled). A hub id
(`"Qwen/Qwen2.5-0.5B"`) is fetched with huggingface_hub when online; a local folder needs no network.
Format: https://huggingface.co/docs/safetensors and https://huggingface.co/docs/transformers/main_classes/model
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from llmlab import REPO_ROOT
from llmlab.config import ModelConfig
from llmlab.cache.sizing import check_fits, element_size
from llmlab.model import Transformer

DEFAULT_MODEL_NAME = "pydoc-llama"
DEFAULT_MODEL_DIR = REPO_ROOT / "data" / "models" / DEFAULT_MODEL_NAME
_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "*.safetensors",
          "model.safetensors.index.json", "quant_config.json"]  # the last: a quantized folder (llmlab.quant.serialize)


def _model_override() -> str:
    """$LLMLAB_MODEL, or "" where it is unset or blank (as an empty LLMLAB_ROOT: Path("") would be the current
    folder, which would become the default model unasked)."""
    return os.environ.get("LLMLAB_MODEL", "").strip()


def default_model_dir() -> Path:
    """The shipped default model's folder (or $LLMLAB_MODEL if set and not blank).

    Raises:
        FileNotFoundError: the folder is absent (llmlab installed without its repository); says how to fix it.
    """
    path = Path(_model_override() or DEFAULT_MODEL_DIR)
    if not (path / "config.json").is_file():
        if _model_override():
            raise FileNotFoundError(f"the default model is not at {path}, where LLMLAB_MODEL points: that folder "
                                    f"has no config.json; point LLMLAB_MODEL at a model folder, or unset it to use "
                                    f"the shipped model")
        raise FileNotFoundError(
            f"the default model is not at {path}. It ships in the llmlab repository under data/models/; install "
            f"llmlab from a clone with `pip install -e .`, run from inside the clone, set LLMLAB_ROOT to the "
            f"clone, or point LLMLAB_MODEL at a model folder"
        )
    return path


def resolve(name_or_path: str | os.PathLike | None) -> Path:
    """Turn 'default', a local folder, or a Hugging Face hub id into a local folder.

    Raises:
        TypeError: name_or_path is not a string or a path (e.g. a number).
        ValueError: name_or_path is an empty (or blank) string.
        FileNotFoundError: a local-looking path that does not exist, or a hub id while offline / not found.
    """
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"the model is {name_or_path!r} ({type(name_or_path).__name__}); give its name or path as a "
                        f"string: 'default' (the shipped model), a local model folder, or a hub id 'org/name'")
    if isinstance(name_or_path, str) and not name_or_path.strip():
        raise ValueError(f"the model name is empty ({name_or_path!r}); give 'default' (the shipped model), a local "
                         f"model folder, or a hub id 'org/name'")
    if name_or_path is None or str(name_or_path) == "default":
        return default_model_dir()
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is a file; give the folder that holds config.json and *.safetensors")
        return path
    text = str(name_or_path)
    from llmlab.config import PRESETS

    if text.lower() in PRESETS:
        raise FileNotFoundError(f"{text!r} is a preset — a model shape with random weights and no tokenizer, not a "
                                f"checkpoint: build it with llmlab.LLM.from_preset({text!r}), or time it with "
                                f"`llmlab bench --model {text}`")
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        import difflib

        near = difflib.get_close_matches(text.lower(), list(PRESETS), n=1, cutoff=0.8)
        hint = (f"; {near[0]!r} is a preset (random weights, no tokenizer): llmlab.LLM.from_preset({near[0]!r}) or "
                f"`llmlab bench --model {near[0]}`" if near else "")
        shipped = Path(_model_override() or DEFAULT_MODEL_DIR)
        if not near and difflib.get_close_matches(path.name.lower(), [shipped.name, "default"], n=1, cutoff=0.7):
            hint = f"; the shipped model is 'default' (the folder {shipped})"
        raise FileNotFoundError(f"model folder {path} does not exist; check the path (or pass a hub id "
                                f"'org/name'){hint}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=_FILES))
    except Exception as e:  # offline, gated, not found: all mean "no such local copy"
        raise FileNotFoundError(
            f"could not fetch {text!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Check the id and your network, or download it once and pass the local folder{_local_hint(path)}"
        ) from e


def _local_hint(path: Path) -> str:
    """When an 'org/name' that the hub does not give is a path whose first folder exists here: say that the local
    folder does not exist either, and name the model folders below it with the closest name."""
    top = path.parts[0] if path.parts else ""
    if not top or not Path(top).is_dir():
        return ""
    import difflib

    found = sorted({str(c.parent) for c in Path(top).glob("*/config.json")} |
                   {str(c.parent) for c in Path(top).glob("*/*/config.json")})
    near = difflib.get_close_matches(str(path), found, n=2, cutoff=0.5)
    return (f". Read as a local path, {str(path)!r} does not exist either (the folder {top!r} does)" +
            (f": did you mean {' or '.join(map(repr, near))}?" if near else ""))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = "has no \"weight_map\"" if isinstance(e, (KeyError, TypeError)) else f"is not valid JSON ({e})"
            raise ValueError(f"{index} {why}: a sharded checkpoint's index maps each tensor name to its shard file "
                             f"({{\"weight_map\": {{\"model.norm.weight\": \"model-00001-of-00002.safetensors\", "
                             f"...}}}}); download or copy it again, or delete it if the folder holds one "
                             f"model.safetensors") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shard(s) {missing} listed in {index.name} are missing")
        return [folder / s for s in shards]
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())  # not a folder named x.safetensors
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" It has {pickled}: llmlab never unpickles weights; convert them once with transformers "
                f"(`model.save_pretrained(folder, safe_serialization=True)`)." if pickled else "")
        raise FileNotFoundError(f"no *.safetensors weights in {folder}.{hint}")
    return files


def load_config(folder: Path) -> ModelConfig:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; a Hugging Face model folder needs one")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg_file} holds a JSON {type(hf).__name__}, not an object of the model's settings "
                         f"({{\"hidden_size\": ..., ...}}): is it the right file?")
    return ModelConfig.from_hf_config(hf, name=folder.name, source=str(cfg_file))


def check_weights_fit(config: ModelConfig, device, dtype: torch.dtype, what: str, fix: str) -> None:
    """Raise MemoryError BEFORE materializing weights that cannot fit in the free memory of `device`.

    One copy of the parameters (`config.num_params()`) in `dtype` is compared with
    `sizing.available_memory(device)` (CUDA free memory, or the host's, container limit included), as the KV
    caches do. The message names `what`, the size needed and available, and `fix`. Raises nothing when it fits.
    """
    n = config.num_params()
    dt = str(dtype).removeprefix("torch.")
    check_fits(n * element_size(dtype), device, f"{what} ({n / 1e9:.2f}B parameters, one copy in {dt})", fix)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Build a `Transformer` from a checkpoint folder or hub id, copying every tensor name for name.

    Args:
        name_or_path: 'default' / None (the shipped model), a local folder, or a hub id.
        device, dtype: where and in which precision the weights live (converted from the file's dtype).

    Raises:
        FileNotFoundError: missing folder, config.json or weight files.
        MemoryError: one copy of the weights in `dtype` does not fit in the free memory (checked before reading
            them, after the weight files are found): loading would certainly fail. Near the limit it may still
            fail: converting from the file's dtype needs a second copy for a moment.
        KeyError: a weight the model needs is not in the checkpoint, or the checkpoint has a tensor the model does
            not expect (the message names it).
        ValueError: a tensor's shape differs from what config.json implies (the message names it and both shapes);
            config.json is not valid JSON, lacks a required key, holds a bad value (`ModelConfig.from_hf_config`)
            or names an unsupported architecture; two weight files hold the same tensor (a stray extra file in a
            folder without model.safetensors.index.json: the message names the tensor and both files); a weights
            file is not valid safetensors (damaged, or a git-lfs pointer: the message says which and the fix); a
            weight holding NaN or inf, in the file or after the cast to `dtype` (the message says which);
            an empty model name (`resolve`).
        TypeError: a model name or path that is not a string or path (`resolve`).
    """
    folder = resolve(name_or_path)
    config = load_config(folder)
    with torch.device("meta"):
        model = Transformer(config)
    files = _weight_files(folder)  # a missing shard is named before any question of memory
    _check_checkpoint_fits(config, folder, torch.device(device), dtype)
    expected = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    tensors: dict[str, torch.Tensor] = {}
    read_from: dict[str, tuple[str, Path]] = {}  # name -> (key, file) it was read from: no file may overwrite another
    for file in files:
        try:
            f = safe_open(str(file), framework="pt")
        except SafetensorError as e:
            raise ValueError(_not_safetensors(file, e)) from None
        with f:
            for key in f.keys():
                name = key.removeprefix("model.")
                if name not in expected:
                    if config.tie_embeddings and name == "lm_head.weight":
                        continue  # some tied checkpoints store the shared matrix twice
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # old checkpoints stored RoPE buffers; llmlab recomputes them
                    layer, _, buffer = name.rpartition(".")
                    if buffer in ("packed", "w_q", "scales") and f"{layer}.weight" in expected:
                        raise ValueError(f"{key!r} in {file.name} is a quantized layer's tensor (int8 w_q / int4 "
                                         f"packed, with scales), but {folder} has no quant_config.json, which says "
                                         f"how to read them; restore that file, or save the model again with "
                                         f"llmlab.quant.save_quantized(llm, folder)")
                    raise KeyError(f"unexpected tensor {key!r} in {file.name}: the model built from config.json has "
                                   f"no such parameter (is config.json from another model?)")
                if name in read_from:
                    raise ValueError(_duplicate_tensor(folder, read_from[name], (key, file)))
                read_from[name] = (key, file)
                t = f.get_tensor(key)
                if t.shape != expected[name]:
                    raise ValueError(f"shape mismatch for {key!r} in {file.name}: checkpoint has {tuple(t.shape)}, "
                                     f"config.json implies {tuple(expected[name])}")
                tensors[name] = _check_finite(t.to(dtype=dtype), t, key, file, dtype)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KeyError(f"weight {missing[0]!r}{more} is missing from the checkpoint in {folder}")
    model = model.to_empty(device=device)
    model.load_state_dict(tensors, strict=False)  # every expected tensor is present: checked above
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=dtype).eval()


def _duplicate_tensor(folder: Path, first: tuple[str, Path], second: tuple[str, Path]) -> str:
    """Why two weight files that both hold one tensor (`first` and `second`: (key, file) each) are refused (the later
    one would silently replace the earlier one's weights), and what to do about it."""
    (key_a, file_a), (key_b, file_b) = first, second
    keys = repr(key_a) if key_a == key_b else f"{key_a!r} / {key_b!r}"
    if (folder / "model.safetensors.index.json").is_file():
        fix = ("model.safetensors.index.json lists both files, yet each tensor belongs to one shard: the index or a "
               "shard is from another model; download or copy the checkpoint again")
    else:
        fix = ("without a model.safetensors.index.json every *.safetensors file in the folder is read, so one of "
               "them is a stray (an older copy, another model's weights): remove the one that does not belong")
    return f"tensor {keys} is in both {file_a.name} and {file_b.name} in {folder}: {fix}"


def _check_finite(t: torch.Tensor, original: torch.Tensor, key: str, file: Path, dtype: torch.dtype) -> torch.Tensor:
    """Refuse a weight holding NaN or inf: a model built from it generates garbage (a NaN logit row makes greedy
    decoding pick token 0 forever) with no error anywhere else. Says whether the file holds them (a damaged or
    diverged checkpoint) or the cast to `dtype` made them (values beyond the dtype's range, e.g. fp16's 65504)."""
    # a NaN or inf anywhere makes the fp32 sum NaN or inf: one reduction, no bool copy (the exact test below runs
    # only when the sum is not finite, which a finite tensor can reach only by overflowing fp32)
    if not t.is_floating_point() or bool(torch.isfinite(t.sum(dtype=torch.float32))) \
            or bool(torch.isfinite(t).all()):
        return t
    if original.dtype != t.dtype and bool(torch.isfinite(original).all()):
        big = original.abs().max().item()
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"weight {key!r} in {file.name} overflows {name} (its largest magnitude is {big:.6g}; {name} "
                         f"stops at {torch.finfo(dtype).max:.6g}): load the model in bf16 or fp32 instead")
    bad = int((~torch.isfinite(original)).sum())
    raise ValueError(f"weight {key!r} in {file.name} holds {bad:,} NaN or inf value(s): the checkpoint is damaged "
                     f"or was saved after training diverged; download or copy it again, or save it from a healthy "
                     f"run")


def _not_safetensors(file: Path, error: Exception) -> str:
    """Why `file` could not be opened as safetensors, and how to get a good copy."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(64)
    if size < 1024 and head.startswith(b"version https://git-lfs"):
        return (f"{file} is a git-lfs pointer ({size} bytes of text), not the weights: the repository was cloned "
                f"without git-lfs. Fetch the real file with `git lfs install && git lfs pull` in that repository, "
                f"or download the model again")
    return (f"{file} ({size:,} bytes) is not a valid safetensors file ({error}): it is damaged, e.g. cut short by "
            f"an interrupted download or copy, or overwritten. Download or copy it again (a hub model: delete its "
            f"folder from the Hugging Face cache and load it again)")


def _check_checkpoint_fits(config: ModelConfig, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what certainly fails: one copy of the weights in `dtype` larger than the free memory of `device` (and,
    for a GPU, of the host, which holds the file's tensors on the way)."""
    what = f"loading the checkpoint {folder.name!r}"
    smaller = " or a smaller dtype (bf16)" if element_size(dtype) > 2 else ""
    default = "" if folder.resolve() == DEFAULT_MODEL_DIR.resolve() else \
        " (the default model: `llmlab.load()`, `--model default`)"
    fix = f"use a smaller model{default}{smaller}, or a machine with more memory (or a GPU with enough free memory)"
    if device.type != "cpu":
        check_weights_fit(config, "cpu", dtype, what + " (host copy)", fix)
    check_weights_fit(config, device, dtype, what, fix)


def load_tokenizer(name_or_path: str | os.PathLike | None = None):
    """The `tokenizers.Tokenizer` from the model folder's tokenizer.json.

    Raises:
        FileNotFoundError: the folder has no tokenizer.json. See `resolve` for the errors of a bad name or path.
        ValueError: tokenizer.json is malformed (the message names the file).
    """
    from tokenizers import Tokenizer

    folder = resolve(name_or_path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json; pass token ids instead of text, or add one")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise ValueError(f"{file} could not be read as a tokenizer ({e}): it is damaged or not a Hugging Face "
                         f"tokenizer.json; copy it again from the model's source") from None


def save_model(model, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors (tied lm_head stored once) so llmlab and transformers can load it;
    given an `LLM` (llm) rather than its Transformer (llm.model), also its tokenizer.json, so that
    `llmlab.load(folder)` generates from text as the LLM did. Returns the folder. Other files already in the folder
    stay as they are (a tokenizer.json among them): save into a new or empty folder.

    Raises TypeError for anything but an LLM or a llmlab Transformer, and ValueError, writing nothing, for a model
    with quantized layers (`llmlab.quant.save_quantized` writes those, with the quant_config.json that says how to
    read them) and for a folder that holds a quantized save (its quant_config.json would describe tensors no longer
    there), an empty folder name, or a folder that cannot be created or written to."""
    from llmlab.quant import quantized_layers

    model, tokenizer = model_and_tokenizer(model, "save_model")
    folder = output_folder(folder, "save_model")
    if quantized_layers(model):
        raise ValueError("save_model writes float weights, but this model's linear layers are quantized: save it "
                         "with llmlab.quant.save_quantized(llm, folder), or save the float model it came from")
    if (folder / "quant_config.json").is_file():
        raise ValueError(f"save_model: {folder} holds a quantized save (quant_config.json); save the float model "
                         f"into another folder, or delete this one first")
    write_model(model, make_writable_folder(folder), dtype)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def model_and_tokenizer(llm_or_model, who: str) -> tuple[Transformer, object]:
    """(Transformer, tokenizer or None) of an `LLM` (its model and tokenizer) or of a bare Transformer (no
    tokenizer). TypeError, named after `who`, for anything else: only a llmlab Transformer, whose config.json
    rebuilds it, can be saved and loaded back."""
    model, tokenizer = llm_or_model, None
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "model", None), torch.nn.Module):
        model, tokenizer = model.model, getattr(model, "tokenizer", None)  # an LLM
    elif not isinstance(model, torch.nn.Module):
        raise TypeError(f"{who}: expected an LLM or its model (a llmlab Transformer), got {type(model).__name__}")
    if not isinstance(model, Transformer):
        raise TypeError(f"{who}: the model is a {type(model).__name__}; only a llmlab Transformer (whose "
                        f"config.json rebuilds it) can be saved and loaded back")
    return model, tokenizer


def output_folder(directory: str | os.PathLike, who: str) -> Path:
    """`directory` as the Path `who` writes a model into. ValueError for an empty name: Path("") is the current
    folder, where a model's files would land unasked."""
    if isinstance(directory, str) and not directory.strip():
        raise ValueError(f"{who}: the folder name is empty; give the folder to write the model into, e.g. "
                         f"'my-model'")
    return Path(directory)


def make_writable_folder(folder: Path, name: str | None = None, contents: str = "the model") -> Path:
    """Create `folder` (and its parents) and write a scratch file in it, so that a bad folder fails before any
    work. ValueError when it cannot, naming it (`name`, default the path), why, and what the folder is for."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{name or folder} cannot be written to ({e.strerror or e}); give a writable folder for "
                         f"{contents}") from None
    return folder


def write_model(model: Transformer, folder: Path, dtype: torch.dtype | None = None) -> Path:
    """What `save_model` writes, unchecked: config.json and model.safetensors with the model's tensors as they are
    (`save_quantized` writes a quantized model's packed weights and scales through it), into a folder its caller
    made (`make_writable_folder`)."""
    state = {}
    for name, t in model.state_dict().items():
        if model.config.tie_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().to("cpu")
        t = (t.to(dtype) if dtype else t).contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view into a larger tensor (the Triton switch fuses q/k/v): safetensors wants its own
        state["model." + name if name != "lm_head.weight" else name] = t
    weights = folder / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors creates the file owner-only (0600); give it the mode any other file gets
    os.umask(umask)
    weights.chmod(0o666 & ~umask)
    hf = model.config.to_hf_config()
    hf["torch_dtype"] = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return folder


def generation_eos(folder: Path, eos: int | list[int] | None) -> int | list[int] | None:
    """config.json's EOS id(s) `eos` plus those the folder's generation_config.json lists: Hugging Face's
    `generate` stops at the latter (chat models often list their end-of-turn token only there). One id stays an int.

    Raises ValueError for a generation_config.json that is not JSON or whose eos_token_id is not an id or ids.
    """
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        return eos
    try:
        extra = json.loads(file.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{file} is not a JSON object ({e}): copy it again from the model's source, or delete it "
                         f"(config.json's eos_token_id is then used)") from None
    ids = []
    for value in (eos, extra):
        value = [] if value is None else [value] if isinstance(value, int) else value
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise ValueError(f"eos_token_id {value!r} ({file.name} or config.json) is not a token id or a list of "
                             f"them: fix the file")
        ids += [i for i in value if i not in ids]
    return None if not ids else ids[0] if len(ids) == 1 else ids
