"""Typed configuration read from the official ``cosyvoice3.yaml``.

The official file is hyperpyyaml: tags such as ``!new:pkg.Class``, ``!name:fn``,
``!apply:fn`` and ``!ref <key>`` would import and execute arbitrary Python if the
file were loaded with hyperpyyaml. A model directory is untrusted input, so we read
it as plain data: every tagged node becomes a :class:`Tagged` record (tag + args),
``!ref`` values are resolved against the document (with ``+ - * /`` arithmetic
between references and numbers, as the official file uses), and nothing is imported.
The dataclasses below then pick out the hyperparameters inference needs.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cosyvoice.errors import ConfigError


@dataclass(frozen=True)
class Tagged:
    """A hyperpyyaml tagged node, e.g. ``!new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT``."""

    kind: str  # "new", "name", "apply"
    target: str  # dotted python path as written in the file
    args: Any  # mapping (keyword args) or list (positional args)


@dataclass(frozen=True)
class _Ref:
    expr: str


class _DataLoader(yaml.SafeLoader):
    """SafeLoader that turns hyperpyyaml tags into inert data."""


def _construct_tagged(loader: _DataLoader, suffix: str, node: yaml.Node) -> Tagged:
    kind, _, target = suffix.partition(":")
    if isinstance(node, yaml.MappingNode):
        args: Any = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        args = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
        args = [] if value in ("", None) else [value]
    return Tagged(kind=kind, target=target, args=args)


def _construct_ref(loader: _DataLoader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


_DataLoader.add_multi_constructor("!", lambda loader, suffix, node: _construct_tagged(loader, suffix, node)
                                  if suffix.split(":")[0] in ("new", "name", "apply")
                                  else _unknown_tag(suffix, node))
_DataLoader.add_constructor("!ref", _construct_ref)


def _unknown_tag(suffix: str, node: yaml.Node) -> Any:
    raise ConfigError(f"unsupported yaml tag '!{suffix}' at line {node.start_mark.line + 1}")


_REF_RE = re.compile(r"<([^<>]+)>")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _eval_arith(expr: str) -> Any:
    """Evaluate ``a * b`` style arithmetic on number literals only (no names, no calls)."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ConfigError(f"unsupported expression in !ref: {expr!r}")

    try:
        return ev(ast.parse(expr, mode="eval"))
    except SyntaxError as exc:
        raise ConfigError(f"cannot parse !ref expression {expr!r}") from exc


def _lookup(doc: dict, dotted: str) -> Any:
    node: Any = doc
    for part in re.split(r"[.\[\]]+", dotted.strip()):
        if part == "":
            continue
        if isinstance(node, Tagged):
            node = node.args
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ConfigError(f"!ref <{dotted}> points at nothing in the yaml") from exc
    return node


def _resolve(value: Any, doc: dict, depth: int = 0) -> Any:
    if depth > 50:
        raise ConfigError("!ref chain too deep (cycle?)")
    if isinstance(value, _Ref):
        refs = _REF_RE.findall(value.expr)
        if len(refs) == 1 and value.expr.strip() == f"<{refs[0]}>":
            return _resolve(_lookup(doc, refs[0]), doc, depth + 1)
        resolved = {}
        for name in refs:
            target = _resolve(_lookup(doc, name), doc, depth + 1)
            if not isinstance(target, (int, float)) or isinstance(target, bool):
                raise ConfigError(f"!ref arithmetic needs numbers, <{name}> is {target!r}")
            resolved[name] = target
        expr = _REF_RE.sub(lambda m: repr(resolved[m.group(1)]), value.expr)
        return _eval_arith(expr)
    if isinstance(value, Tagged):
        return Tagged(value.kind, value.target, _resolve(value.args, doc, depth + 1))
    if isinstance(value, dict):
        return {k: _resolve(v, doc, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, doc, depth + 1) for v in value]
    return value


def read_hyperpyyaml(path: str | Path) -> dict[str, Any]:
    """Parse a hyperpyyaml file as data: tags become :class:`Tagged`, ``!ref`` is resolved."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    try:
        doc = yaml.load(text, Loader=_DataLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name} is not valid yaml: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{path.name} must be a yaml mapping at the top level")
    return _resolve(doc, doc)


# ----------------------------------------------------------------------------- dataclasses


@dataclass(frozen=True)
class QwenConfig:
    """The Qwen2 backbone, from ``CosyVoice-BlankEN/config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (``ras_sampling``) parameters."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LLMConfig:
    llm_input_size: int
    llm_output_size: int
    speech_token_size: int
    qwen: QwenConfig
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass(frozen=True)
class DiTConfig:
    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50
    num_decoding_left_chunks: int = -1


@dataclass(frozen=True)
class CFMConfig:
    in_channels: int = 240
    spk_emb_dim: int = 80
    sigma_min: float = 1e-6
    t_scheduler: str = "cosine"
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10


@dataclass(frozen=True)
class FlowConfig:
    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    pre_lookahead_channels: int
    dit: DiTConfig
    cfm: CFMConfig


@dataclass(frozen=True)
class F0PredictorConfig:
    num_class: int = 1
    in_channels: int = 80
    cond_channels: int = 512


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    conv_pre_look_right: int
    f0_predictor: F0PredictorConfig

    @property
    def upsample_scale(self) -> int:
        """Waveform samples per mel frame (480 for the released model)."""
        scale = self.istft_hop_len
        for r in self.upsample_rates:
            scale *= r
        return scale


@dataclass(frozen=True)
class CosyVoice3Config:
    """Everything inference needs from ``cosyvoice3.yaml`` + the tokenizer's config.json."""

    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    num_decoding_left_chunks: int
    llm: LLMConfig
    flow: FlowConfig
    hift: HiFTConfig
    allowed_special: str = "all"


# ----------------------------------------------------------------------------- builders


def _node(doc: dict, key: str, expected: str | None = None) -> Tagged:
    node = doc.get(key)
    if not isinstance(node, Tagged) or node.kind != "new" or not isinstance(node.args, dict):
        raise ConfigError(f"cosyvoice3.yaml: '{key}' must be a '!new:' mapping node")
    if expected and not node.target.endswith(expected):
        raise ConfigError(f"cosyvoice3.yaml: '{key}' builds {node.target}, expected a {expected}")
    return node


def _get(args: dict, key: str, where: str, typ: type | tuple[type, ...] = (int, float), default: Any = ...) -> Any:
    if key not in args:
        if default is ...:
            raise ConfigError(f"cosyvoice3.yaml: '{where}.{key}' is missing")
        return default
    value = args[key]
    if typ is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if typ is float and isinstance(value, int):
        value = float(value)
    if typ is float and isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)  # yaml 1.1 reads '1e-06' as a string
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
        raise ConfigError(f"cosyvoice3.yaml: '{where}.{key}' = {value!r} has the wrong type")
    return value


def _pos_int(args: dict, key: str, where: str) -> int:
    value = _get(args, key, where, int)
    if value <= 0:
        raise ConfigError(f"cosyvoice3.yaml: '{where}.{key}' must be positive, got {value}")
    return value


def read_qwen_config(path: str | Path) -> QwenConfig:
    """Read the Qwen2 hyperparameters from ``CosyVoice-BlankEN/config.json``."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable Qwen2 config.json ({exc})") from exc
    where = "CosyVoice-BlankEN/config.json"
    try:
        cfg = QwenConfig(
            vocab_size=_pos_int(raw, "vocab_size", where),
            hidden_size=_pos_int(raw, "hidden_size", where),
            intermediate_size=_pos_int(raw, "intermediate_size", where),
            num_hidden_layers=_pos_int(raw, "num_hidden_layers", where),
            num_attention_heads=_pos_int(raw, "num_attention_heads", where),
            num_key_value_heads=_pos_int(raw, "num_key_value_heads", where),
            rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("cosyvoice3.yaml: ", f"{path}: ")) from None
    if cfg.hidden_size % cfg.num_attention_heads or cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{path}: hidden_size/heads/kv heads are inconsistent")
    return cfg


def _llm_config(doc: dict[str, Any], qwen: QwenConfig) -> LLMConfig:
    """The ``llm`` node with its sampling; its sizes must match the Qwen2 config's."""
    llm = _node(doc, "llm", "CosyVoice3LM").args
    sampling_node = llm.get("sampling")
    sargs = sampling_node.args if isinstance(sampling_node, Tagged) and isinstance(sampling_node.args, dict) else {}
    sampling = SamplingConfig(
        top_p=_get(sargs, "top_p", "llm.sampling", float, 0.8),
        top_k=_get(sargs, "top_k", "llm.sampling", int, 25),
        win_size=_get(sargs, "win_size", "llm.sampling", int, 10),
        tau_r=_get(sargs, "tau_r", "llm.sampling", float, 0.1),
    )
    llm_cfg = LLMConfig(
        llm_input_size=_pos_int(llm, "llm_input_size", "llm"),
        llm_output_size=_pos_int(llm, "llm_output_size", "llm"),
        speech_token_size=_pos_int(llm, "speech_token_size", "llm"),
        qwen=qwen,
        sampling=sampling,
    )
    if llm_cfg.llm_input_size != qwen.hidden_size or llm_cfg.llm_output_size != qwen.hidden_size:
        raise ConfigError(
            f"cosyvoice3.yaml: llm_input_size/llm_output_size ({llm_cfg.llm_input_size}/{llm_cfg.llm_output_size}) "
            f"must equal the Qwen2 hidden_size ({qwen.hidden_size}) in CosyVoice-BlankEN/config.json")
    return llm_cfg


def _new_node(parent: dict[str, Any], key: str, where: str) -> Tagged:
    """``parent[key]``, which must be a ``!new:`` node with keyword arguments."""
    node = parent.get(key)
    if not isinstance(node, Tagged) or not isinstance(node.args, dict):
        raise ConfigError(f"cosyvoice3.yaml: '{where}.{key}' must be a '!new:' node")
    return node


def _decoder_configs(dec: Tagged) -> tuple[DiTConfig, CFMConfig]:
    """The flow decoder's DiT estimator and its conditional flow matching parameters."""
    e = _new_node(dec.args, "estimator", "flow.decoder").args
    cfm_params = dec.args.get("cfm_params")
    cfm_args: dict = {}
    if isinstance(cfm_params, Tagged) and isinstance(cfm_params.args, dict):
        cfm_args = cfm_params.args.get("content", cfm_params.args)
    dit = DiTConfig(
        dim=_pos_int(e, "dim", "flow.decoder.estimator"),
        depth=_pos_int(e, "depth", "flow.decoder.estimator"),
        heads=_pos_int(e, "heads", "flow.decoder.estimator"),
        dim_head=_pos_int(e, "dim_head", "flow.decoder.estimator"),
        ff_mult=_pos_int(e, "ff_mult", "flow.decoder.estimator"),
        mel_dim=_get(e, "mel_dim", "flow.decoder.estimator", int, 80),
        mu_dim=_get(e, "mu_dim", "flow.decoder.estimator", int, 80),
        spk_dim=_get(e, "spk_dim", "flow.decoder.estimator", int, 80),
        out_channels=_get(e, "out_channels", "flow.decoder.estimator", int, 80),
        static_chunk_size=_get(e, "static_chunk_size", "flow.decoder.estimator", int, 50),
        num_decoding_left_chunks=_get(e, "num_decoding_left_chunks", "flow.decoder.estimator", int, -1),
    )
    cfm = CFMConfig(
        in_channels=_get(dec.args, "in_channels", "flow.decoder", int, 240),
        spk_emb_dim=_get(dec.args, "spk_emb_dim", "flow.decoder", int, 80),
        sigma_min=_get(cfm_args, "sigma_min", "flow.decoder.cfm_params", float, 1e-6),
        t_scheduler=_get(cfm_args, "t_scheduler", "flow.decoder.cfm_params", str, "cosine"),
        inference_cfg_rate=_get(cfm_args, "inference_cfg_rate", "flow.decoder.cfm_params", float, 0.7),
    )
    return dit, cfm


def _flow_config(doc: dict[str, Any], speech_token_size: int) -> FlowConfig:
    """The ``flow`` node; its vocabulary is the LLM's speech tokens."""
    flow = _node(doc, "flow", "CausalMaskedDiffWithDiT").args
    pre = _new_node(flow, "pre_lookahead_layer", "flow")
    dit, cfm = _decoder_configs(_new_node(flow, "decoder", "flow"))
    flow_cfg = FlowConfig(
        input_size=_pos_int(flow, "input_size", "flow"),
        output_size=_pos_int(flow, "output_size", "flow"),
        spk_embed_dim=_pos_int(flow, "spk_embed_dim", "flow"),
        vocab_size=_pos_int(flow, "vocab_size", "flow"),
        token_mel_ratio=_pos_int(flow, "token_mel_ratio", "flow"),
        pre_lookahead_len=_pos_int(flow, "pre_lookahead_len", "flow"),
        pre_lookahead_channels=_pos_int(pre.args, "channels", "flow.pre_lookahead_layer"),
        dit=dit,
        cfm=cfm,
    )
    if flow_cfg.vocab_size != speech_token_size:
        raise ConfigError(
            f"cosyvoice3.yaml: llm.speech_token_size ({speech_token_size}) must equal flow.vocab_size "
            f"({flow_cfg.vocab_size}); the released model uses 6561 for both")
    return flow_cfg


def _hift_config(doc: dict[str, Any]) -> HiFTConfig:
    """The ``hift`` vocoder node with its F0 predictor and iSTFT parameters."""
    hift = _node(doc, "hift", "CausalHiFTGenerator").args
    f0 = hift.get("f0_predictor")
    f0_args = f0.args if isinstance(f0, Tagged) and isinstance(f0.args, dict) else {}
    istft = hift.get("istft_params") or {}
    where = "hift"
    hift_cfg = HiFTConfig(
        in_channels=_pos_int(hift, "in_channels", where),
        base_channels=_pos_int(hift, "base_channels", where),
        nb_harmonics=_pos_int(hift, "nb_harmonics", where),
        sampling_rate=_pos_int(hift, "sampling_rate", where),
        nsf_alpha=_get(hift, "nsf_alpha", where, float),
        nsf_sigma=_get(hift, "nsf_sigma", where, float),
        nsf_voiced_threshold=_get(hift, "nsf_voiced_threshold", where, float),
        upsample_rates=tuple(_get(hift, "upsample_rates", where, list)),
        upsample_kernel_sizes=tuple(_get(hift, "upsample_kernel_sizes", where, list)),
        istft_n_fft=_pos_int(istft, "n_fft", "hift.istft_params"),
        istft_hop_len=_pos_int(istft, "hop_len", "hift.istft_params"),
        resblock_kernel_sizes=tuple(_get(hift, "resblock_kernel_sizes", where, list)),
        resblock_dilation_sizes=tuple(tuple(d) for d in _get(hift, "resblock_dilation_sizes", where, list)),
        source_resblock_kernel_sizes=tuple(_get(hift, "source_resblock_kernel_sizes", where, list)),
        source_resblock_dilation_sizes=tuple(
            tuple(d) for d in _get(hift, "source_resblock_dilation_sizes", where, list)),
        lrelu_slope=_get(hift, "lrelu_slope", where, float, 0.1),
        audio_limit=_get(hift, "audio_limit", where, float, 0.99),
        conv_pre_look_right=_get(hift, "conv_pre_look_right", where, int, 4),
        f0_predictor=F0PredictorConfig(
            num_class=_get(f0_args, "num_class", "hift.f0_predictor", int, 1),
            in_channels=_get(f0_args, "in_channels", "hift.f0_predictor", int, 80),
            cond_channels=_get(f0_args, "cond_channels", "hift.f0_predictor", int, 512),
        ),
    )
    if len(hift_cfg.upsample_rates) != len(hift_cfg.upsample_kernel_sizes):
        raise ConfigError("cosyvoice3.yaml: hift.upsample_rates and upsample_kernel_sizes differ in length")
    return hift_cfg


def build_config(doc: dict[str, Any], qwen: QwenConfig) -> CosyVoice3Config:
    """Turn the parsed yaml (see :func:`read_hyperpyyaml`) into :class:`CosyVoice3Config`."""
    llm_cfg = _llm_config(doc, qwen)
    flow_cfg = _flow_config(doc, llm_cfg.speech_token_size)
    hift_cfg = _hift_config(doc)
    sample_rate = _pos_int(doc, "sample_rate", "top level")
    if hift_cfg.sampling_rate != sample_rate:
        raise ConfigError(
            f"cosyvoice3.yaml: hift.sampling_rate ({hift_cfg.sampling_rate}) != sample_rate ({sample_rate})")
    return CosyVoice3Config(
        sample_rate=sample_rate,
        token_frame_rate=_get(doc, "token_frame_rate", "top level", int, 25),
        token_mel_ratio=_get(doc, "token_mel_ratio", "top level", int, flow_cfg.token_mel_ratio),
        chunk_size=_get(doc, "chunk_size", "top level", int, 25),
        num_decoding_left_chunks=_get(doc, "num_decoding_left_chunks", "top level", int, -1),
        llm=llm_cfg,
        flow=flow_cfg,
        hift=hift_cfg,
        allowed_special=str(doc.get("allowed_special", "all")),
    )


def load_config(model_dir: str | Path) -> CosyVoice3Config:
    """Read ``cosyvoice3.yaml`` and ``CosyVoice-BlankEN/config.json`` of a model directory."""
    model_dir = Path(model_dir)
    qwen = read_qwen_config(model_dir / "CosyVoice-BlankEN" / "config.json")
    return build_config(read_hyperpyyaml(model_dir / "cosyvoice3.yaml"), qwen)
