"""Save and load a weight-only quantized model: the packed weights and their scales in safetensors, beside a
quant_config.json that says how they were made, so a quantized model loads without its float weights.

    save_quantized(llm.quantize("int4", group_size=128), "out/pydoc-int4")
    llm = load_quantized("out/pydoc-int4")          # an LLM with Int4Linear layers: the same logits as before

The folder:

    config.json        the model's Hugging Face config (as `llmlab.checkpoint.save_model` writes it)
    model.safetensors  every tensor of the model's state_dict, named as `save_model` names them ("model." + the
                       llmlab name; a float lm_head.weight bare, as Hugging Face names it; a quantized lm_head's
                       tensors take the prefix like every other layer's): a quantized layer stores <layer>.w_q int8
                       (N, K) and <layer>.scales fp32 (N,) (int8), or <layer>.packed uint8 (N, Kp/2) and
                       <layer>.scales fp32 (N, Kp/G) (int4, Kp = K padded to a multiple of the group size G:
                       llmlab/quant/linear.py, "Padding"), and its bias if it has one; the other tensors
                       (embedding, norms) keep their dtype; a tied lm_head that is not quantized is stored once, as
                       the embedding
    quant_config.json  {"quant_format": "llmlab-weight-only", "format_version": 1, "scheme": "int4",
                        "group_size": 128 (null for int8), "symmetric": true, "include_lm_head": false,
                        "method": "rtn", "dtype": "float32" (the unquantized tensors'), "llmlab_version": "0.1.0",
                        "layers": {"layers.0.self_attn.q_proj": {"in_features": K, "padded_in_features": Kp,
                                   "out_features": N, "bias": false, "dtype": "float32"}, ...}}
                       (a layer's "dtype" is its weight's before quantization, what `dequantize_model` restores)
    tokenizer.json     when the LLM has a tokenizer

`load_quantized` rebuilds the model from config.json, puts an Int8Linear / Int4Linear of the recorded shapes where
quant_config.json lists one, checks every tensor of model.safetensors against what that model expects (names,
shapes, dtypes; a scheme, layer list or group size the tensors contradict is refused, naming the layer) and loads
them strictly. Hugging Face transformers cannot load such a folder: the quantized layers have no `weight`.

Format of the tensors: `llmlab.kernels.weight_quant` (symmetric, no zero points). The idea of shipping a quantized
checkpoint as packed tensors plus a quantization config is that of Hugging Face's `quantization_config`
(https://huggingface.co/docs/transformers/main_classes/quantization) and of AutoGPTQ / AutoAWQ checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from llmlab import __version__
from llmlab.cache.sizing import check_fits
from llmlab.checkpoint import (_check_finite, _not_safetensors, load_config, load_tokenizer, make_writable_folder,
                               model_and_tokenizer, output_folder, write_model)
from llmlab.kernels.weight_quant import SCALE_LIMIT
from llmlab.model import Transformer

from .linear import Int4Linear, Int8Linear, padded_k
from .quantize import SCHEMES, quantized_layers

__all__ = ["QUANT_CONFIG", "save_quantized", "load_quantized", "is_quantized_checkpoint"]

QUANT_CONFIG = "quant_config.json"
WEIGHTS = "model.safetensors"
FORMAT, FORMAT_VERSION = "llmlab-weight-only", 1
_TENSORS = {"int8": ("w_q", "scales"), "int4": ("packed", "scales")}  # what a layer stores, per scheme
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_quantized_checkpoint(folder: str | os.PathLike) -> bool:
    """True when `folder` holds a quant_config.json (a folder `save_quantized` wrote): one file look-up, for
    `llmlab.load` to choose `load_quantized` over `llmlab.checkpoint.load_model`."""
    return (Path(folder) / QUANT_CONFIG).is_file()


# -- what a quantized model stores -----------------------------------------------------------------------------------


def _unpack(llm_or_model) -> tuple[Transformer, object, str]:
    """(model, tokenizer or None, method) of an `LLM` or a bare model."""
    model, tokenizer = model_and_tokenizer(llm_or_model, "save_quantized")
    method = getattr(llm_or_model, "quant_method", None) or getattr(model, "quant_method", None)
    if method is not None and not isinstance(method, str):
        raise TypeError(f"save_quantized: quant_method is {method!r}; it names how the weights were rounded, a "
                        f"string such as 'rtn', 'awq' or 'gptq'")
    return model, tokenizer, method or "rtn"


def _quant_config(model: Transformer, method: str) -> dict:
    """quant_config.json's dict for a quantized model (see the module docstring).

    Raises ValueError for a model with no quantized layer, whose layers differ in scheme or group size, or
    whose quantized layers stand for weights of another dtype than the model's."""
    layers = quantized_layers(model)
    if not layers:
        raise ValueError("save_quantized: the model has no quantized layer; quantize it first (llm.quantize(...) or "
                         "llmlab.quant.quantize_model), or save a float model with llmlab.checkpoint.save_model")
    kinds = {name: (m.scheme, getattr(m, "group_size", None)) for name, m in layers.items()}
    first = next(iter(kinds))
    for name, kind in kinds.items():
        if kind != kinds[first]:
            raise ValueError(f"save_quantized: layers {first!r} ({kinds[first]}) and {name!r} ({kind}) differ in "
                             f"(scheme, group size); quant_config.json records one of each: quantize the whole "
                             f"model with one quantize_model call")
    scheme, group_size = kinds[first]
    dtype = next(model.parameters()).dtype
    for name, m in layers.items():  # load_quantized reads one dtype for the model and its layers
        if m.orig_dtype != dtype:
            raise ValueError(f"save_quantized: layer {name!r} stands for a {_dtype_name(m.orig_dtype)} weight in a "
                             f"{_dtype_name(dtype)} model; bring the whole model to one dtype first "
                             f"(model.to(dtype) moves the quantized layers' dtype too)")
    return {
        "quant_format": FORMAT, "format_version": FORMAT_VERSION, "scheme": scheme, "group_size": group_size,
        "symmetric": True, "include_lm_head": "lm_head" in layers, "method": method,
        "dtype": _dtype_name(dtype), "llmlab_version": __version__,
        "layers": {name: {"in_features": m.in_features, "padded_in_features": m.padded_in_features,
                          "out_features": m.out_features, "bias": m.bias is not None,
                          "dtype": _dtype_name(m.orig_dtype)} for name, m in layers.items()},
    }


def _skeleton(model: Transformer, qc: dict, source: str, orig_dtype: torch.dtype | None = None) -> Transformer:
    """Swap a meta-device Int8Linear / Int4Linear of the shapes quant_config.json records into `model` (a
    Transformer on the meta device) for each layer it lists, after checking those shapes against the layer's.
    orig_dtype: the layers' `orig_dtype` and bias dtype (None: each layer's recorded "dtype")."""
    scheme, G = qc["scheme"], qc["group_size"]
    for name, info in qc["layers"].items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            linear = None
        if type(linear) is not nn.Linear:
            raise ValueError(f"{source} lists layer {name!r}, which is not a linear layer of the model config.json "
                             f"describes: the quantization config belongs to another model")
        K, Kp, N = info["in_features"], info["padded_in_features"], info["out_features"]
        if (K, N) != (linear.in_features, linear.out_features) or info["bias"] != (linear.bias is not None):
            raise ValueError(f"layer {name!r}: {source} says in_features {K}, out_features {N}, bias {info['bias']}; "
                             f"config.json's model has {linear.in_features}, {linear.out_features}, "
                             f"{linear.bias is not None}: the two files belong to different models")
        want = K if scheme == "int8" else padded_k(K, G)
        if Kp != want:
            how = "int8 is never padded" if scheme == "int8" else f"K = {K} at group_size {G} pads to {want}"
            raise ValueError(f"layer {name!r}: {source} gives padded_in_features {Kp}, but {how}: its group_size or "
                             f"the layer's entry was changed")
        meta, dt = dict(device="meta"), orig_dtype or _DTYPES[info["dtype"]]
        bias = torch.empty(N, dtype=dt, **meta) if info["bias"] else None
        if scheme == "int8":
            q = Int8Linear(torch.empty(N, K, dtype=torch.int8, **meta), torch.empty(N, **meta), bias, dt)
        else:
            q = Int4Linear(torch.empty(N, Kp // 2, dtype=torch.uint8, **meta), torch.empty(N, Kp // G, **meta),
                           bias, dt, in_features=K)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
    return model


def _check_tensors(expected: dict[str, torch.Tensor], qc: dict, tensors: dict[str, torch.Tensor], source: str,
                   config_file: str = QUANT_CONFIG) -> None:
    """Every tensor of `tensors` (from `source`) is one of `expected` (the skeleton's state_dict) with its shape and,
    for the quantized layers' tensors, its dtype (the others: any float dtype, cast at load). The message of a
    disagreement names the layer and what disagrees.

    Raises:
        ValueError: a tensor of the other scheme in a listed layer; a quantized layer the config does not list; a
            listed layer stored as a float weight; an unexpected or missing tensor; a wrong shape or dtype (scales
            of another width: the group size they imply and the config's).
    """
    scheme, layers = qc["scheme"], qc["layers"]
    names = _TENSORS[scheme]
    for key in tensors:
        if key in expected:
            continue
        layer, _, leaf = key.rpartition(".")
        if leaf in ("w_q", "packed", "scales") and layer in layers:
            other = "int4" if leaf == "packed" else "int8"
            raise ValueError(f"layer {layer!r}: {config_file} says scheme {scheme!r} (tensors {' and '.join(names)}), "
                             f"but {source} holds {key!r}, a tensor of {other}: the config does not belong to these "
                             f"tensors")
        if leaf in ("w_q", "packed", "scales"):
            raise ValueError(f"layer {layer!r} is quantized in {source} ({key!r}), but {config_file} does not list "
                             f"it: the config does not belong to these tensors (was a layer removed from it?)")
        if leaf == "weight" and layer in layers:
            raise ValueError(f"layer {layer!r} is listed in {config_file} as {scheme}, but {source} holds its float "
                             f"weight {key!r}: the config does not belong to these tensors")
        raise ValueError(f"unexpected tensor {key!r} in {source}: the model that config.json and {config_file} "
                         f"describe has no such tensor")
    for key, want in expected.items():
        layer, _, leaf = key.rpartition(".")
        quantized = layer in layers and leaf != "bias"
        if key not in tensors:
            what = f"layer {layer!r} ({scheme} in {config_file}): its {leaf!r}" if layer in layers else repr(key)
            raise ValueError(f"{what} is missing from {source}")
        t = tensors[key]
        if quantized and leaf == "scales" and scheme == "int4" and t.dim() == 2 and t.shape[0] == want.shape[0] \
                and t.shape[1] != want.shape[1]:
            Kp, G = layers[layer]["padded_in_features"], qc["group_size"]
            implied = f"groups of {Kp / t.shape[1]:g} weights" if t.shape[1] else "no groups"
            raise ValueError(f"layer {layer!r}: scales {tuple(t.shape)} over Kp = {Kp} make {implied}, but "
                             f"{config_file} says group_size {G} ({want.shape[1]} scales per row): the group size "
                             f"does not match these tensors")
        if t.shape != want.shape:
            where = f"layer {layer!r}: " if layer in layers else ""
            raise ValueError(f"{where}{key!r} in {source} has shape {tuple(t.shape)}, but {config_file} and "
                             f"config.json imply {tuple(want.shape)}")
        if quantized and t.dtype != want.dtype or not quantized and not t.is_floating_point():
            want_dt = _dtype_name(want.dtype) if quantized else "a float dtype"
            where = f"layer {layer!r}: " if layer in layers else ""
            raise ValueError(f"{where}{key!r} in {source} is {_dtype_name(t.dtype)}, expected {want_dt} "
                             f"({scheme if quantized else 'an unquantized tensor'})")


# -- save ------------------------------------------------------------------------------------------------------------


def save_quantized(llm_or_model, directory: str | os.PathLike) -> Path:
    """Write a quantized model to `directory`: model.safetensors, quant_config.json, config.json, and tokenizer.json
    when an LLM with a tokenizer is given (module docstring). Returns the folder.

    Args:
        llm_or_model: an `LLM` (llm.quantize(...)) or its `Transformer` after `quantize_model`. The method recorded
            is its `quant_method` attribute (on the LLM, else the model) when set, else "rtn" (round to nearest).
        directory: created if absent. A folder that already holds a float model (model.safetensors without
            quant_config.json, or sharded weights) is refused, so a checkpoint is never overwritten. A quantized
            save there is replaced, its tokenizer.json too: removed when the new model has no tokenizer.

    Raises:
        TypeError: not an LLM or a llmlab Transformer; a quant_method that is not a string; a directory that is not
            a path.
        ValueError: the model is not quantized, or its layers differ in scheme, group size or dtype; its modules are not
            those a Transformer built from its config holds (a Triton-kernel or fused module swapped in: swap them
            out first); the folder holds another model, its name is empty (it would be the current folder) or it
            cannot be created or written to. Nothing is written then.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"save_quantized: directory must be a folder path (a str or pathlib.Path), got "
                        f"{type(directory).__name__} {directory!r}")
    model, tokenizer, method = _unpack(llm_or_model)
    qc = _quant_config(model, method)
    with torch.device("meta"):
        skeleton = Transformer(model.config)
    expected = _skeleton(skeleton, qc, "the model").state_dict()
    try:
        _check_tensors(expected, qc, model.state_dict(), "the model", config_file="its quantized layers")
    except ValueError as e:
        raise ValueError(f"save_quantized: the model does not hold what a quantized Transformer built from its "
                         f"config holds ({e}); save the Int8Linear / Int4Linear layers quantize_model made, in "
                         f"their formats (fp32 scales), under the Transformer's names: swap any Triton kernel "
                         f"modules out first (llmlab.kernels.modules.swap_out(model))") from None
    folder = output_folder(directory, "save_quantized")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"save_quantized: {folder} is a file; give a folder to write the model into")
    others = sorted(p.name for p in folder.glob("*.safetensors*") if p.name != WEIGHTS) if folder.is_dir() else []
    if others or ((folder / WEIGHTS).is_file() and not is_quantized_checkpoint(folder)):
        raise ValueError(f"save_quantized: {folder} already holds a model ({', '.join(others) or WEIGHTS}); save into "
                         f"a new or empty folder (a quantized save there is overwritten, never a float checkpoint)")
    replacing = is_quantized_checkpoint(folder)
    make_writable_folder(folder)
    (folder / QUANT_CONFIG).unlink(missing_ok=True)  # until the new one is written, the folder is no quantized save
    write_model(model, folder)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(str(folder / "tokenizer.json"))
    elif replacing:  # the old save's tokenizer would be read with this model's ids
        (folder / "tokenizer.json").unlink(missing_ok=True)
    (folder / QUANT_CONFIG).write_text(json.dumps(qc, indent=2) + "\n")
    return folder


# -- load ------------------------------------------------------------------------------------------------------------


def _read_quant_config(folder: Path) -> dict:
    """quant_config.json, checked for the keys and values `load_quantized` relies on."""
    file = folder / QUANT_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no {QUANT_CONFIG}: it is not a quantized save (save_quantized writes "
                                f"one); load a float checkpoint with llmlab.load")
    try:
        qc = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); save the model again") from None

    def bad(what: str) -> ValueError:
        return ValueError(f"{file}: {what}; the file is damaged or edited by hand: save the model again")

    if not isinstance(qc, dict) or qc.get("quant_format") != FORMAT:
        raise bad(f"\"quant_format\" is not {FORMAT!r}")
    version = qc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise bad(f"\"format_version\" {version!r} is not one this llmlab ({__version__}) reads "
                  f"(1 to {FORMAT_VERSION}; a newer llmlab wrote it?)")
    if qc.get("scheme") not in SCHEMES:
        raise bad(f"\"scheme\" is {qc.get('scheme')!r}, not one of {SCHEMES}")
    G = qc.get("group_size")
    if qc["scheme"] == "int4" and (isinstance(G, bool) or not isinstance(G, int) or G <= 0 or G % 32):
        raise bad(f"\"group_size\" is {G!r}; int4 needs a positive multiple of 32")
    if qc["scheme"] == "int8" and G is not None:
        raise bad(f"\"group_size\" is {G!r}, but int8 has one scale per row (null)")
    if qc.get("symmetric") is not True:
        raise bad(f"\"symmetric\" is {qc.get('symmetric')!r}; these formats are symmetric (no zero points: "
                  f"llmlab.quant.linear's notes), so it must be true")
    if qc.get("dtype") not in _DTYPES:
        raise bad(f"\"dtype\" is {qc.get('dtype')!r}, not one of {sorted(_DTYPES)}")
    layers = qc.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise bad("\"layers\" is not a non-empty object of layer name -> shapes")
    for name, info in layers.items():
        ints = ("in_features", "padded_in_features", "out_features")
        if not isinstance(info, dict) or not all(isinstance(info.get(k), int) and not isinstance(info.get(k), bool)
                                                 and info[k] > 0 for k in ints) \
                or not isinstance(info.get("bias"), bool) or info.get("dtype") not in _DTYPES:
            raise bad(f"layer {name!r} needs positive ints {', '.join(ints)}, a bool \"bias\" and a \"dtype\" of "
                      f"{sorted(_DTYPES)}; got {info!r}")
        if info["dtype"] != qc["dtype"]:
            raise bad(f"layer {name!r} has \"dtype\" {info['dtype']!r}, the model {qc['dtype']!r}; save_quantized "
                      f"records one dtype for both")
    if qc.get("include_lm_head") is not ("lm_head" in layers):
        raise bad(f"\"include_lm_head\" is {qc.get('include_lm_head')!r} but lm_head is "
                  f"{'' if 'lm_head' in layers else 'not '}in \"layers\"")
    if not isinstance(qc.get("method"), str):
        raise bad(f"\"method\" is {qc.get('method')!r}, not a string such as 'rtn'")
    return qc


def _check_scales(scales: torch.Tensor, layer: str, scheme: str, file: Path) -> None:
    """Scales the quantizers can write: finite and positive (they clamp a zero group's scale to 1e-12 / 127 or / 7,
    never 0), and for int4 below `weight_quant.SCALE_LIMIT`, the M = 1 GEMVs' range. ValueError naming the layer
    otherwise."""
    if scales.is_floating_point() and not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).sum())
        raise ValueError(f"layer {layer!r}: {file.name} holds {bad:,} NaN or inf scale(s); the quantizers write "
                         f"finite scales only, so the file is damaged or edited by hand: save the model again")
    low = scales.min().item()
    if low <= 0:
        raise ValueError(f"layer {layer!r}: {file.name} holds a scale of {low:g}; the quantizers write positive "
                         f"scales only, so the file is damaged or edited by hand: save the model again")
    if scheme == "int4" and scales.max().item() >= SCALE_LIMIT:
        raise ValueError(f"layer {layer!r}: {file.name} holds an int4 scale of {scales.max().item():.3g}, at or "
                         f"above 2^96, beyond the int4 kernels' range (quantize_int4 refuses such weights): the "
                         f"file is damaged or edited by hand: save the model again")


def _read_tensors(file: Path, tied_lm_head: bool) -> dict[str, torch.Tensor]:
    """{llmlab name: tensor} of the safetensors file (on the CPU, in the file's dtypes); "model." prefixes dropped,
    and a tied lm_head stored beside the embedding skipped, as `llmlab.checkpoint.load_model` does."""
    try:
        f = safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise ValueError(_not_safetensors(file, e)) from None
    tensors = {}
    with f:
        for key in f.keys():
            name = key.removeprefix("model.")
            if not (tied_lm_head and name == "lm_head.weight"):
                tensors[name] = f.get_tensor(key)
    return tensors


def load_quantized(directory: str | os.PathLike, device=None, dtype=None):
    """An `LLM` from a folder `save_quantized` wrote: the model rebuilt from config.json with Int8Linear /
    Int4Linear layers where quant_config.json lists them, every tensor checked, then loaded strictly.

    Args:
        directory: the folder.
        device: 'auto' / None (CUDA when there is one), 'cpu', 'cuda', 'cuda:N' (`llmlab.engine.pick_device`).
        dtype: None keeps the saved dtype of the unquantized tensors (embedding, norms, biases; quant_config.json's
            "dtype"); 'fp32' / 'bf16' / 'fp16' or a torch dtype casts them (and becomes the quantized layers'
            `orig_dtype`). The packed tensors and their fp32 scales are loaded as saved.

    Returns:
        An `LLM` named after the folder, with its tokenizer when tokenizer.json is there, and `quant_method` set
        to the saved method.

    Raises:
        FileNotFoundError: no such folder, or no quant_config.json, config.json or model.safetensors in it.
        ValueError: quant_config.json that is not valid, or that disagrees with config.json's model or with the
            tensors (the message names the layer: a swapped scheme, a layer missing from the config or from the
            file, a shape or dtype, a group size the scales contradict); model.safetensors not valid safetensors;
            a tensor holding NaN or inf; scales no quantizer writes (zero or negative; int4 at 2^96 or more); an
            unknown device or dtype.
        MemoryError: the file does not fit in the free memory of the device (checked before reading it).
    """
    from llmlab.checkpoint import generation_eos
    from llmlab.engine import LLM, pick_device, pick_dtype  # engine imports llmlab.quant

    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"load_quantized: {folder} is not a folder; give the one save_quantized wrote")
    qc = _read_quant_config(folder)
    config = load_config(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{folder} has no {WEIGHTS}: save the model again (save_quantized)")
    dev = pick_device(device)
    dt = _DTYPES[qc["dtype"]] if dtype is None else pick_dtype(dtype, dev)
    check_fits(weights.stat().st_size, dev, f"loading the quantized model {folder.name!r}",
               "use a machine with more memory (or a GPU with enough free memory)")
    with torch.device("meta"):
        model = Transformer(config).to(dt)
    model = _skeleton(model, qc, QUANT_CONFIG, orig_dtype=None if dtype is None else dt)
    tied = config.tie_embeddings and not qc["include_lm_head"]
    tensors = _read_tensors(weights, tied)
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    _check_tensors(expected, qc, tensors, WEIGHTS)
    quantized = {f"{name}.{leaf}" for name in qc["layers"] for leaf in _TENSORS[qc["scheme"]]}
    for name in qc["layers"]:  # first: a quantized file's scales have their own rules (and message)
        _check_scales(tensors[f"{name}.scales"], name, qc["scheme"], weights)
    for key, t in tensors.items():
        if t.is_floating_point():
            cast = t if key in quantized else t.to(expected[key].dtype)
            tensors[key] = _check_finite(cast, t, key, weights, cast.dtype)
    if tied:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    model = model.to_empty(device=dev)
    model.load_state_dict(tensors, strict=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval()
    tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    model.config.eos_token_id = generation_eos(folder, model.config.eos_token_id)
    llm = LLM(model, tokenizer, name=folder.name)
    llm.quant_method = qc["method"]
    return llm
