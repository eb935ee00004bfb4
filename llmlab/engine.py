"""`LLM`: a model, its tokenizer, a device and a dtype, with `generate(text)` — what the labs and the CLI use.

    >>> import llmlab
    >>> llm = llmlab.load()                      # the shipped default model, offline
    >>> g = llm.generate("The list", max_new_tokens=32)
    >>> print(g.text, g.ttft_ms, g.tpot_ms, g.tokens_per_s)

`LLM.from_preset("llama-3.2-1b")` builds a real model's shape with RANDOM weights, for the speed labs.
"""

from __future__ import annotations

import copy
import numbers
import os
import warnings

import torch

from llmlab.batching.continuous import generate_continuous
from llmlab.batching.one_at_a_time import one_at_a_time
from llmlab.batching.static import StaticGeneration, as_static, check_prompts, generate_static, is_ragged
from llmlab.checkpoint import check_weights_fit, generation_eos, load_model, load_tokenizer, resolve
from llmlab.config import ModelConfig
from llmlab.runtime.cuda_graphs import RunnerCache
from llmlab.runtime.fast_generate import decode_mode, generate_fast
from llmlab.generate import Generation, check_flags, check_seed, generate
from llmlab.model import Transformer

# LLM.generate's batching values: how the prompts of one call share the model (llmlab.batching; lab 06)
BATCHING = (None, "static", "continuous", "one_at_a_time")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """'auto' / None -> cuda if available, else cpu.

    Raises:
        ValueError: 'cuda' asked for on a machine without a CUDA GPU.
    """
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported by llmlab: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but PyTorch sees no CUDA GPU here; use the CPU "
                         f"(device 'cpu')")
    return device


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None -> bf16 on CUDA, fp32 on CPU. Accepts 'fp32', 'bf16', 'fp16' (or their long names) or one of those
    three torch dtypes.

    Raises:
        ValueError: an unknown dtype name, or a torch dtype the model does not run in (int8, float64, ...).
    """
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not one llmlab runs a model in; use torch.float32, torch.bfloat16 or "
                             f"torch.float16 (or 'fp32', 'bf16', 'fp16'); for int8 / int4 weights: "
                             f"llm.quantize('int8')")
        return dtype
    if dtype not in DTYPES:
        quant = (" (int8 / int4 are weight formats, not dtypes: llm.quantize('int8'), or the ladder's +int8 / +int4 "
                 "rungs)") if isinstance(dtype, str) and dtype.lower().startswith(("int", "uint")) else ""
        raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16{quant}")
    return DTYPES[dtype]


def check_fast_paths(device: torch.device, use_cache: bool = True, cuda_graphs: bool = False,
                     torch_compile: bool = False, gpu_sampling: bool = False, prefill_graphs: bool = False,
                     cache_factory: bool = False, switch_names: dict[str, str] | None = None) -> None:
    """Refuse `LLM.generate` switches that cannot run on `device` or together, before any work: the one rule that
    `LLM.generate` and `llmlab.switches.apply_switches` both run (the latter before any switch changes the model,
    and again as each switch sets its generate arguments).

    switch_names: {generate argument: the switch that set it} (`apply_switches`): a cache_factory refused with a
    fast path is then named by the switches, not by the arguments.

    Raises:
        ValueError: cuda_graphs or prefill_graphs on a model not on a CUDA GPU (turn them off), prefill_graphs
            without cuda_graphs on a CUDA model (turn cuda_graphs on too), cuda_graphs / torch_compile /
            gpu_sampling without the KV cache (turn it on, or them off), or with a cache_factory (True: one is
            given; the fast paths decode on their own static KV cache).
    """
    graphs = [name for name, on in (("cuda_graphs", cuda_graphs), ("prefill_graphs", prefill_graphs)) if on]
    if graphs and device.type != "cuda":
        if len(graphs) == 1:
            raise ValueError(f"{graphs[0]}=True needs a model on a CUDA GPU (this one is on {device.type}); turn it "
                             f"off")
        raise ValueError(f"cuda_graphs=True and prefill_graphs=True need a model on a CUDA GPU (this one is on "
                         f"{device.type}); turn them off")
    if prefill_graphs and not cuda_graphs:
        raise ValueError("prefill_graphs=True captures the prefill beside the decode step's CUDA graphs: turn "
                         "cuda_graphs on too")
    fast = [name for name, on in (("cuda_graphs", cuda_graphs), ("torch_compile", torch_compile),
                                  ("gpu_sampling", gpu_sampling)) if on]
    if fast and not use_cache:
        raise ValueError(f"CUDA graphs, torch.compile and GPU sampling decode on a static KV cache (here: "
                         f"{', '.join(f'{name}=True' for name in fast)}), but use_cache=False turns the cache off: "
                         f"turn the KV cache on (use_cache=True, the kv_cache switch) or turn {' and '.join(fast)} "
                         f"off")
    if fast and cache_factory:
        names = switch_names or {}
        if "cache_factory" in names:
            raise ValueError(f"switch {names['cache_factory']!r} picks a KV cache for the eager decode, and with "
                             f"{', '.join(repr(names.get(name, name)) for name in fast)} on the decode runs on its "
                             f"own static KV cache: turn one side off")
        raise ValueError("cache_factory runs on the eager path only, and cuda_graphs / torch_compile / "
                         "gpu_sampling decode on their own static KV cache: drop cache_factory or those switches")


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> Transformer:
    """A `Transformer(config)` with random weights (the distribution of `Transformer(config)`, not its values:
    that one's layers draw torch's default init first), built in `dtype` on `device` without an fp32 copy of the
    whole model: laid out on the meta device, allocated in `dtype`, then initialised by `Transformer._init_weights`,
    which draws each matrix in fp32 (from torch's global generator: seed it first) and rounds it to `dtype`. An
    8B-parameter preset in bf16 then needs ~16 GB, not the 32 GB of fp32-then-cast.
    """
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    model = model.to_empty(device=device)  # RotaryEmbedding recomputes its fp32 inv_freq here
    model.apply(Transformer._init_weights)  # a tied lm_head is the embedding: drawn twice, as in __init__
    return model.eval()


def check_text_prompt(prompt: str) -> None:
    """Raise ValueError for a text prompt that is empty or only whitespace: the model would continue from the
    tokenizer's start token (BOS) alone, producing text unrelated to anything the user asked for."""
    if not prompt.strip():
        raise ValueError(f"the prompt {prompt!r} is empty or only whitespace: give some text to continue, e.g. "
                         f"llm.generate(\"The list\"); to generate from the start token alone, pass its id: "
                         f"llm.generate(llm.encode(\"\"))")


class LLM:
    """A decoder plus (optionally) its tokenizer, on one device in one dtype.

    Args:
        model: a `Transformer` already on its device and in its dtype.
        tokenizer: a `tokenizers.Tokenizer`, or None (then prompts must be token ids).
        name: shown in tables and plots.
        random_weights: True for preset models — their text is noise.

    Attributes besides those: `kernels`, the Triton kernels' decode step (`llmlab.kernels.KernelDecodeStep`) while
    the "Triton kernels" switch is on, else None; `runners`, the decode runners (`llmlab.runtime.cuda_graphs.
    RunnerCache`) the fast paths captured for this model, reused by the next `generate`.
    """

    def __init__(self, model: Transformer, tokenizer=None, name: str = "model", random_weights: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.random_weights = random_weights
        self.kernels = None
        self.runners = RunnerCache()
        self.quant_method = None  # how quantized weights were rounded ("rtn", "awq"; `save_quantized` records it)

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str | os.PathLike | None = "default", device=None, dtype=None) -> "LLM":
        """Load a checkpoint: 'default' (the model shipped in data/models/), a local Hugging Face folder, or a
        hub id (needs network once). A folder written by `llmlab.quant.serialize.save_quantized` (it has
        quant_config.json) loads as that quantized model (dtype None keeps the saved one). See
        `llmlab.checkpoint.resolve` (a name that is not a string or path, or an empty one) and
        `llmlab.checkpoint.load_model` for the errors raised."""
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        folder = resolve(name_or_path)
        from llmlab.quant.serialize import is_quantized_checkpoint, load_quantized

        if is_quantized_checkpoint(folder):  # a folder `llmlab.quant.serialize.save_quantized` wrote
            return load_quantized(folder, device=dev, dtype=None if dtype is None else dt)
        model = load_model(folder, device=dev, dtype=dt)
        try:
            tokenizer = load_tokenizer(folder)
        except FileNotFoundError:
            tokenizer = None
        model.config.eos_token_id = generation_eos(folder, model.config.eos_token_id)
        return cls(model, tokenizer, name=folder.name)

    @classmethod
    def from_preset(cls, preset: str, device=None, dtype=None, seed: int = 0, **overrides) -> "LLM":
        """A real model's shape with RANDOM weights (normal, std 0.02): right for timing, useless for text.

        The weights are drawn from `seed` (the same seed, the same weights); torch's global random state is left as
        the caller had it.

        Raises:
            ValueError: unknown preset name (the message lists the presets); a seed outside torch's range.
            TypeError: an override that is not a ModelConfig field; a seed that is not an int.
            MemoryError: the weights in `dtype` would not fit in the free memory of the device (checked before
                building; the model is built directly in `dtype`, see `random_model`).
        """
        check_seed(seed)
        config = ModelConfig.from_preset(preset, **overrides)
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        check_weights_fit(config, dev, dt, f"building preset {preset!r}",
                          "use a smaller preset, or the default model (`--model default`, `llmlab.load()`), or a "
                          "machine with more memory (or a GPU with enough free memory)")
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # the caller's RNG state stays
            torch.manual_seed(seed)
            model = random_model(config, dev, dt)
        return cls(model, None, name=f"{config.name} (random weights)", random_weights=True)

    # -- properties -------------------------------------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def eos_token_id(self):
        return self.config.eos_token_id

    def to(self, device=None, dtype=None) -> "LLM":
        """This LLM on another device and/or dtype, as a new object (the original keeps its weights).

        Returns self when nothing changes. dtype: a torch.dtype or 'fp32' / 'bf16' / 'fp16'. Quantized layers keep
        their packed weights and fp32 scales as they are (moved, not converted); their bias and activations take the
        new dtype.
        """
        dev = self.device if device is None else pick_device(device)
        dt = self.dtype if dtype is None else pick_dtype(dtype, dev)
        if dev == self.device and dt == self.dtype:
            return self
        model = copy.deepcopy(self.model).to(device=dev, dtype=dt)  # kernel modules stay kernel modules
        llm = LLM(model, self.tokenizer, name=self.name, random_weights=self.random_weights)
        llm.kernels = None if self.kernels is None else self.kernels.for_model(model)
        llm.quant_method = self.quant_method
        return llm

    def quantize(self, scheme: str, group_size: int | None = None, include_lm_head: bool = False,
                 inplace: bool = False, method: str = "rtn", calibration: str | torch.Tensor | None = None,
                 progress: bool = True) -> "LLM":
        """This LLM with weight-only quantized linear layers.

        scheme: "int8" (per output channel: one scale per row, so no group_size) or "int4" (group-wise, `group_size`
        inputs per scale; None: 128). The embedding stays as it is; lm_head only with include_lm_head. method: "rtn"
        rounds the weights to nearest (`llmlab.quant.quantize_model`); "awq" first searches activation-aware scales
        on calibration tokens and folds them into the weights (`llmlab.quant.quantize_awq`, Lin et al. 2023,
        https://arxiv.org/abs/2306.00978), with a progress bar over the layers unless progress=False. calibration
        (awq only): text (cut into 16 windows of 256 tokens by `llmlab.quant.calibration_ids`), token ids
        (n_samples, seq_len), or None for the default model's held-out text (`llmlab.quant.heldout_text`).
        Returns a new LLM on a copy of the model (the original keeps its weights, for side-by-side comparisons), or
        self when inplace=True (no second copy in memory); its name gains the scheme, " g<group_size>" for int4,
        " awq" for awq and " +lm_head" with include_lm_head.
        Raises, before changing anything: ValueError for an unknown method, a scheme or group size the layers cannot
        take, a group_size given with int8, a model already quantized, the "Triton kernels" switch on (its decode
        step was built for the float model), calibration given with method="rtn", or calibration text too short
        (`calibration_ids`); TypeError for calibration that is neither text nor a tensor of ids, or text without a
        tokenizer, and for include_lm_head, inplace or progress not True / False.
        """
        from llmlab.kernels._util import check_flag
        from llmlab.quant import calibration_ids, quantize_awq, quantize_model
        from llmlab.quant.awq import check_quantizable

        if method not in ("rtn", "awq"):
            raise ValueError(f"quantize: unknown method {method!r}; use 'rtn' (round to nearest) or 'awq' "
                             f"(activation-aware scaling, calibrated)")
        for flag, value in (("include_lm_head", include_lm_head), ("inplace", inplace), ("progress", progress)):
            check_flag("quantize", flag, value)  # "no" would count as True
        if scheme == "int8" and group_size is not None:
            raise ValueError(f"quantize: int8 keeps one scale per output channel (row), so group_size={group_size!r} "
                             f"has no meaning there; drop group_size, or use scheme='int4' for groups")
        if group_size is None:
            group_size = 128
        if self.kernels is not None:
            raise ValueError("quantize: the Triton kernels switch is on, and its decode step was built for the "
                             "float model; quantize the LLM without it (apply the switch afterwards)")
        ids = None
        if method == "rtn" and calibration is not None:
            raise ValueError("quantize: calibration is used by method='awq' only; drop it, or pass method='awq'")
        if method == "awq":
            if isinstance(calibration, torch.Tensor):
                ids = calibration
            elif calibration is None or isinstance(calibration, str):
                if self.tokenizer is None:
                    raise TypeError(f"quantize: {self.name} has no tokenizer to cut calibration text into tokens; "
                                    f"pass token ids: calibration=torch.tensor (n_samples, seq_len)")
                ids = calibration_ids(self, calibration)
            else:
                raise TypeError(f"quantize: calibration must be text (a str), token ids (a LongTensor (n_samples, "
                                f"seq_len)) or None (the default model's held-out text); got "
                                f"{type(calibration).__name__}")
        # refused before the copy or any layer changes (RTN with inplace=True swaps layer by layer), named "quantize"
        check_quantizable("quantize", self.model, scheme, group_size, include_lm_head, ids)
        llm = self if inplace else LLM(copy.deepcopy(self.model), self.tokenizer, name=self.name,
                                       random_weights=self.random_weights)
        if method == "awq":
            quantize_awq(llm.model, ids, scheme, group_size=group_size, include_lm_head=include_lm_head,
                         progress=progress)
        else:
            quantize_model(llm.model, scheme, group_size=group_size, include_lm_head=include_lm_head)
        llm.runners = RunnerCache()  # graphs captured before hold the old layers
        llm.name = f"{self.name} {scheme}" + (f" g{group_size}" if scheme == "int4" else "") \
            + (" awq" if method == "awq" else "") + (" +lm_head" if include_lm_head else "")
        llm.quant_method = method  # what `llmlab.quant.serialize.save_quantized` records
        return llm

    def encode(self, text: str) -> list[int]:
        """Text -> token ids (with BOS where the tokenizer's post-processor adds one). Raises ValueError without a
        tokenizer or for text that is not valid Unicode; TypeError for anything but a str."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name} has no tokenizer: pass token ids (a list of ints) instead of text")
        if not isinstance(text, str):
            raise TypeError(f"encode takes text (a str), not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a badly decoded file: the tokenizer's TypeError
            raise ValueError(f"the prompt is not valid Unicode text: {text[e.start:e.end]!r} at position {e.start} "
                             f"is half of a surrogate pair; read the text with the right encoding (UTF-8), or "
                             f"drop that character") from None
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        """Token ids (a list of ints, or a 1-D tensor / array of them) -> text. Raises ValueError without a
        tokenizer, for a batch (decode each row: `Generation.texts`) or an id outside the vocabulary; TypeError
        for anything but ints (text is `encode`'s)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name} has no tokenizer to turn ids back into text")
        if hasattr(ids, "tolist"):  # a tensor or numpy array
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"decode takes token ids (a list of ints), got {type(ids).__name__} {ids!r:.60}; "
                            f"text goes the other way, through encode")
        ids = list(ids)
        if any(isinstance(i, (list, tuple)) for i in ids):
            raise ValueError("decode takes one sequence of ids, not a batch: decode each row")
        bad = [i for i in ids if isinstance(i, bool) or not hasattr(i, "__index__")]  # ints, numpy's too
        if bad:
            raise TypeError(f"decode takes token ids (ints), got {type(bad[0]).__name__} {bad[0]!r:.60}")
        ids = [i.__index__() for i in ids]
        vocab = self.model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad_id = min(ids) if min(ids) < 0 else max(ids)
            raise ValueError(f"token id {bad_id} is outside the model's vocabulary (ids 0..{vocab - 1}); were the ids "
                             f"made by another model?")
        return self.tokenizer.decode(ids)

    # -- generation -------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[int] | list[list[int]] | torch.Tensor,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        seed: int | None = None,
        stop_at_eos: bool = True,
        on_token=None,
        cuda_graphs: bool = False,
        torch_compile: bool = False,
        gpu_sampling: bool = False,
        pin_memory: bool = False,
        cache_factory=None,
        prefill_graphs: bool = False,
        batching: str | None = None,
    ) -> Generation:
        """Generate a continuation of `prompt` (text, a list of texts, or token ids).

        Returns a `Generation`: `.text` (the continuation, when there is a tokenizer; for a batch of prompts, the
        first row's, and `.texts` holds one per row), `.token_ids`, `.ttft_ms`,
        `.tpot_ms`, `.tokens_per_s`. `on_token(step, tokens)` is called after each step (return True to stop).
        cuda_graphs / torch_compile / gpu_sampling (the switches of `llmlab.switches`) decode through
        `llmlab.runtime.fast_generate.generate_fast` on a static KV cache; with none of them set, the eager
        `llmlab.generate.generate` runs. Either path runs the Triton kernels' forward when `kernels` is set (the
        "Triton kernels" switch), the fast ones on this LLM's `runners`. pin_memory copies the prompt through pinned
        memory (CUDA).
        prefill_graphs (with cuda_graphs): the prefill too is replayed from a CUDA graph, of the prompt padded to
        a length bucket (`llmlab.runtime.cuda_graphs`).
        top_k / top_p at temperature 0 (greedy) have no effect: a UserWarning says so (`warn_greedy_filters`).
        Raises ValueError for an empty prompt (text that is empty or only whitespace, `check_text_prompt`, or no
        token ids), one longer than the context, bad sampling settings, or a seed outside
        -2**63 .. 2**64 - 1 (and for the switches `check_fast_paths` refuses: the fast switches without the KV
        cache, cuda_graphs or prefill_graphs on a model not on a CUDA GPU, prefill_graphs without cuda_graphs,
        a cache_factory with a fast switch);
        TypeError for arguments of the wrong type (a prompt that is not text or int token ids, a max_new_tokens or
        seed that is not an int, a sampling setting that is not a number, an on/off argument that is not a bool,
        an on_token that is not callable); the model is untouched by a failed call.
        cache_factory (eager path only): the KV cache class, e.g. `llmlab.cache.paged_cache.PagedKVCache` (the
        `paged_kv` switch); the fast paths keep their static cache, so cache_factory with cuda_graphs,
        torch_compile or gpu_sampling is a ValueError.
        A list of texts is encoded row by row (it needs a tokenizer; TypeError without one) and runs as a batch.
        Prompts of different lengths (a list of token-id lists) run as one left-padded static batch
        (`llmlab.batching.static.generate_static`, on the runner that cuda_graphs / torch_compile pick): the result
        is a `StaticGeneration` whose `.padding` counts the padding waste; use_cache=False, a cache_factory and
        prefill_graphs are refused with them (ValueError).
        batching: None (as above), "static" (the same: one left-padded batch, whose result is a `StaticGeneration`
            also when the prompts are of one length: its padding is then zero), "continuous": every prompt a
        request of a continuous-batching engine (`llmlab.batching.continuous.generate_continuous`: a paged KV pool,
        requests leave as they finish); with the Triton kernels switch its decode rows run the paged-attention
        kernel, captured per batch-size bucket with cuda_graphs (which needs that switch); torch_compile,
        gpu_sampling, prefill_graphs, use_cache=False, a cache_factory and on_token are refused with it
        (ValueError naming them); or
        "one_at_a_time": no batching at all, each prompt its own call (batch 1) on the switches given, one after
        the other, as a server without batching would serve requests that all arrived at once: `.step_ms` is
        every call's steps in order and `.extra["requests"]` gives each request's TTFT counted from the start, the
        time it waited for the requests before it included, its TPOT and its finish_reason. With "continuous" and
        "one_at_a_time", `.ttft_ms`, `.tpot_ms` and `.metrics` are read from those per-request timings (means over
        the requests), and `.finish_reason` is "stopped" when on_token stopped a call, "eos" when every request
        stopped at EOS, else "length".
        Sampling (temperature > 0) with a seed is reproducible within one batching mode, not across modes: a
        static batch draws every row from one generator, continuous batching gives request i the seed seed + i,
        and one_at_a_time seeds each call with the same seed. Greedy output is the same in every mode at fp32; in
        bf16 / fp16 a batch's other matmul shapes can flip a near-tie.
        """
        if batching not in BATCHING:
            raise ValueError(f"batching={batching!r}: give one of {', '.join(map(repr, BATCHING))}")
        check_flags(use_cache=use_cache, stop_at_eos=stop_at_eos, cuda_graphs=cuda_graphs,
                    torch_compile=torch_compile, gpu_sampling=gpu_sampling, pin_memory=pin_memory,
                    prefill_graphs=prefill_graphs)
        check_fast_paths(self.device, use_cache=use_cache, cuda_graphs=cuda_graphs, torch_compile=torch_compile,
                         gpu_sampling=gpu_sampling, prefill_graphs=prefill_graphs,
                         cache_factory=cache_factory is not None)
        # text is encoded here (the tokenizer's post-processor adds BOS where the model expects one); token ids (a
        # list, a list of equal-length lists, a 1-D or 2-D tensor) are checked by `prepare_prompt`
        texts = [prompt] if isinstance(prompt, str) else None
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            if self.tokenizer is None:  # a batch of texts: one prompt per row, any lengths
                raise TypeError(f"{self.name} has no tokenizer to encode a list of texts: give token ids (lists of "
                                f"ints) instead")
            texts = list(prompt)
        for text in texts or ():
            check_text_prompt(text)
        if texts is None:
            ids = prompt
        else:
            ids = self.encode(texts[0]) if isinstance(prompt, str) else [self.encode(t) for t in texts]
        if self.random_weights and texts is not None:
            warnings.warn(f"{self.name}: the weights are random, the text will be noise", stacklevel=2)
        common = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      eos_token_id=self.eos_token_id if stop_at_eos else None, on_token=on_token)
        if batching == "one_at_a_time":
            rows = [ids] if isinstance(ids, torch.Tensor) and ids.dim() == 1 else list(ids)
            if rows and isinstance(rows[0], numbers.Integral):  # one prompt as a flat list (or array) of ids
                rows = [rows]
            if not rows:
                raise ValueError("prompt: no token ids given; give a prompt (text, or a list of token ids)")
            # every prompt checked before the first call (an error names prompts[i]), as the batched modes do
            rows = check_prompts(rows, max_new_tokens, self.config.max_seq_len, self.config.vocab_size, pad_id=0)
            settings = dict(use_cache=use_cache, cuda_graphs=cuda_graphs, torch_compile=torch_compile,
                            gpu_sampling=gpu_sampling, pin_memory=pin_memory, cache_factory=cache_factory,
                            prefill_graphs=prefill_graphs, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=stop_at_eos, on_token=on_token)
            return one_at_a_time([self.generate([r], **settings) for r in rows])
        if batching == "continuous":
            off = [name for name, on in (("use_cache=False", not use_cache), ("torch_compile", torch_compile),
                                         ("gpu_sampling", gpu_sampling), ("prefill_graphs", prefill_graphs),
                                         ("cache_factory", cache_factory is not None),
                                         ("on_token", on_token is not None)) if on]
            if off:
                # a left-padded static batch refuses the same cache options (below); one at a time takes them all
                static_too = not (set(off) & {"use_cache=False", "prefill_graphs", "cache_factory"})
                raise ValueError(f"batching='continuous' runs its own engine on a paged KV pool "
                                 f"(llmlab.batching.engine), which cannot take {', '.join(off)}: turn "
                                 f"{'it' if len(off) == 1 else 'them'} off, or use batching='one_at_a_time'"
                                 + (" or batching='static'" if static_too else ""))
            # with the Triton kernels switch the decode rows run the paged kernel, graph-captured with cuda_graphs
            g = generate_continuous(self.model, ids, cuda_graphs=cuda_graphs or None, **common)
        elif is_ragged(ids):  # prompts of different lengths: one left-padded static batch
            # each named as an argument and as the switch that sets it (`llmlab.switches`)
            off = [name for name, on in (("use_cache=False (the kv_cache switch off)", not use_cache),
                                         ("prefill_graphs=True (the prefill_graphs switch)", prefill_graphs),
                                         ("a cache_factory (the paged_kv switch)", cache_factory is not None)) if on]
            if off:
                raise ValueError(f"prompts of different lengths run as one left-padded batch on a static KV cache "
                                 f"(llmlab.batching.static), which cannot take {' or '.join(off)}: drop "
                                 f"{'it' if len(off) == 1 else 'them'}, give prompts of equal length, or use "
                                 f"batching='one_at_a_time'")
            # eagerly (no graphs to keep) the batch gets a cache of exactly its length: the shared runners' caches
            # are sized for captured graphs, and every eager step would attend over all of their slots
            fast = cuda_graphs or torch_compile
            g = generate_static(self.model, ids, mode=decode_mode(cuda_graphs, torch_compile),
                                runners=self.runners if fast else None, kernels=self.kernels, pin_memory=pin_memory,
                                **common)
        elif cuda_graphs or torch_compile or gpu_sampling:
            g = generate_fast(self.model, ids, mode=decode_mode(cuda_graphs, torch_compile),
                              gpu_sampling=gpu_sampling, pin_memory=pin_memory, prefill_graph=prefill_graphs,
                              runners=self.runners, kernels=self.kernels, **common)
        else:
            g = generate(self.model, ids, use_cache=use_cache, pin_memory=pin_memory, cache_factory=cache_factory,
                         kernels=self.kernels, **common)
        if batching == "static" and not isinstance(g, StaticGeneration):
            g = as_static(g)  # equal-length prompts ran as one batch without padding: its result says so
        if self.tokenizer is not None:
            eos = self.eos_token_id
            eos = {eos} if isinstance(eos, int) else set(eos or [])
            g.texts = [self.decode([t for t in row if t not in eos]) for row in g.token_ids]
            g.text = g.texts[0]
        return g

    def __repr__(self) -> str:
        c = self.config
        return (f"LLM({self.name!r}, {c.num_params() / 1e6:.1f}M params, {c.n_layers} layers, dim {c.dim}, "
                f"{c.n_heads} heads / {c.n_kv_heads} KV heads, device={self.device}, dtype={self.dtype})")


def load(name_or_path: str | os.PathLike | None = "default", device=None, dtype=None) -> LLM:
    """Load a model and its tokenizer into an `LLM` (the same as `LLM.load`): the course's first call.

    Args:
        name_or_path: 'default' or None (the 7.7M-parameter model shipped in data/models/pydoc-llama), a local
            Hugging Face folder (config.json + *.safetensors, Llama / Mistral / Qwen2), or a hub id 'org/name'
            (downloaded once; needs network).
        device: 'auto' / None (CUDA when there is one, else the CPU), 'cpu', 'cuda' or 'cuda:N'.
        dtype: None (bf16 on CUDA, fp32 on a CPU), 'fp32', 'bf16', 'fp16' or the matching torch dtype.

    Raises:
        FileNotFoundError: no such folder, a preset name (presets are shapes: `LLM.from_preset`), a hub id while
            offline, or a folder without config.json / weight files.
        ValueError: an unknown device or dtype, 'cuda' on a machine without one, a checkpoint whose config or
            tensor shapes do not match (see `llmlab.checkpoint.load_model`).
        MemoryError: the weights would not fit in the free memory of the device (checked before reading them).
    """
    return LLM.load(name_or_path, device=device, dtype=dtype)
