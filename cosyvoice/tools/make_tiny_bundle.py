"""Write a tiny, randomly initialised Fun-CosyVoice3 model directory in the official layout.

    python -m cosyvoice.tools.make_tiny_bundle DIR [--seed N]

Tests and CI need a complete model directory that loads in seconds and can be regenerated offline. The
bundle has the released file set and key layout with small dims (the shared golden ``tiny_bundle`` is
the model for it): the official yaml structure, the three state dicts of *our* modules with every parameter
random, ONNX stand-ins with the official I/O contracts, and a working byte-level BPE tokenizer trained
here on a small English+Chinese corpus. The output is a pure function of the seed (same bytes twice).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from safetensors.torch import save_file
from torch import nn

from cosyvoice.bundle import DEFAULT_MODEL_DIR, DEMO_MODEL_DIR, DEMO_WARNING, TOKENIZER_DIR, validate_model_dir
from cosyvoice.config import load_config
from cosyvoice.errors import ModelBundleError
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.hifigan import CausalHiFTGenerator
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.tools.tiny_onnx import campplus_onnx, speech_tokenizer_onnx
from cosyvoice.tools.tiny_qwen import qwen_files, train_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyDims:
    """The shrunken sizes; every other hyperparameter keeps the released model's value."""

    hidden: int = 12  # Qwen2 hidden size = llm_input_size = llm_output_size
    layers: int = 2
    heads: int = 3
    kv_heads: int = 1
    intermediate: int = 32
    pre_lookahead_channels: int = 64
    dit_dim: int = 64
    dit_depth: int = 2
    dit_heads: int = 4
    dit_dim_head: int = 16
    dit_ff_mult: int = 2
    hift_channels: int = 32
    f0_channels: int = 32
    tokenizer_channels: int = 32  # stand-in speech tokenizer conv width
    campplus_hidden: int = 48  # stand-in speaker encoder hidden width


STOP_ROWS = 200  # llm_decoder rows after the speech tokens: sos, eos, task id, fill and unused ids
STOP_ROW_SCALE = 0.05  # shrinks their logits so sampled generations run past the first token
F0_HZ, F0_SPREAD_HZ = 120.0, 40.0  # predicted pitch lands in the voiced range, so the harmonic source is used
CONV_POST_GAIN = 0.25  # small iSTFT log-magnitudes/phases: audio stays mostly below the clipping limit

# ----------------------------------------------------------------------------- cosyvoice3.yaml

_YAML = """\
# Tiny randomly initialised CosyVoice3 bundle written by cosyvoice.tools.make_tiny_bundle (seed {seed}).
# Same structure and tags as the released cosyvoice3.yaml; only the network widths/depths are shrunk.
__set_seed1: !apply:random.seed [{seed}]
__set_seed2: !apply:numpy.random.seed [{seed}]
__set_seed3: !apply:torch.manual_seed [{seed}]
__set_seed4: !apply:torch.cuda.manual_seed_all [{seed}]

sample_rate: 24000
llm_input_size: {d.hidden}
llm_output_size: {d.hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {d.pre_lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {d.dit_dim}
            depth: {d.dit_depth}
            heads: {d.dit_heads}
            dim_head: {d.dit_dim_head}
            ff_mult: {d.dit_ff_mult}
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {d.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {d.f0_channels}

# Training-only sections below are kept so the official loader sees the file it expects.
mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 6000
    min_length: 100
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24960
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
    num_frames: 960
compute_whisper_fbank: !name:cosyvoice.dataset.processor.compute_whisper_fbank
    num_frames: 960
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: 480
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False

data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <compute_whisper_fbank>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]
data_pipeline_gan: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <truncate>,
    !ref <compute_fbank>,
    !ref <compute_f0>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

train_conf:
    optim: adam
    optim_conf:
        lr: 1e-5
    scheduler: constantlr
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1

train_conf_gan:
    optim: adam
    optim_conf:
        lr: 0.0002
    scheduler: constantlr
    optim_d: adam
    optim_conf_d:
        lr: 0.0002
    scheduler_d: constantlr
    max_epoch: 200
    grad_clip: 5
    accum_grad: 1
    log_interval: 100
    save_per_step: -1
"""

# ----------------------------------------------------------------------------- random streams


def _generator(seed: int, part: str) -> torch.Generator:
    """An independent stream per part, so changing one module's size leaves the other files unchanged."""
    digest = hashlib.sha256(f"{seed}:{part}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


# ----------------------------------------------------------------------------- checkpoints


@torch.no_grad()
def randomise_(module: nn.Module, gen: torch.Generator) -> nn.Module:
    """Overwrite every parameter with seeded random values of a scale that keeps activations moderate.

    Norm gains, Snake alphas and weight-norm magnitudes are randomised too (around 1, positive where the
    formula needs it), so a loader that skips any of them is caught by the parity tests.
    """
    tables = {f"{name}.weight" for name, child in module.named_modules() if isinstance(child, nn.Embedding)}
    for name, param in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "alpha" or leaf == "original0":  # Snake frequency, weight-norm magnitude: positive
            value = 0.5 + torch.rand(param.shape, generator=gen)
        elif name in tables:  # unit-variance rows, like nn.Embedding's own initialisation
            value = torch.randn(param.shape, generator=gen)
        elif param.dim() == 1 and "norm" in name and leaf == "weight":
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif param.dim() == 1:
            value = 0.1 * torch.randn(param.shape, generator=gen)
        else:
            fan_in = param[0].numel()
            value = torch.randn(param.shape, generator=gen) * fan_in ** -0.5
        param.copy_(value)
    return module


def _state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Plain contiguous tensors, keeping storage sharing (tied weights stay one storage in the file)."""
    copies: dict[int, torch.Tensor] = {}
    state = {}
    for key, tensor in module.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in copies:
            copies[ptr] = tensor.detach().clone().contiguous()
        state[key] = copies[ptr]
    return state


def _write_checkpoints(out_dir: Path, seed: int) -> None:
    """Build our three modules from the written yaml, randomise them and save their state dicts."""
    config = load_config(out_dir)
    with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG; keep the caller's
        llm = randomise_(CosyVoice3LM(config.llm), _generator(seed, "llm"))
        flow = randomise_(CausalMaskedDiffWithDiT(config.flow), _generator(seed, "flow"))
        hift = randomise_(CausalHiFTGenerator(config.hift), _generator(seed, "hift"))
    llm_state = _state_dict(llm)
    n_speech = config.llm.speech_token_size
    llm_state["llm_decoder.weight"][n_speech:n_speech + STOP_ROWS] *= STOP_ROW_SCALE
    if config.llm.qwen.tie_word_embeddings:  # the released file stores the tied matrix under both names
        llm_state["llm.model.lm_head.weight"] = llm_state["llm.model.model.embed_tokens.weight"]
    torch.save(llm_state, out_dir / "llm.pt")
    torch.save(_state_dict(flow), out_dir / "flow.pt")

    hift_state = _state_dict(hift)
    classifier = hift_state["f0_predictor.classifier.weight"]
    classifier.copy_(torch.randn(classifier.shape, generator=_generator(seed, "f0")) * F0_SPREAD_HZ
                     / classifier.shape[1] ** 0.5)
    hift_state["f0_predictor.classifier.bias"].fill_(F0_HZ)
    hift_state["conv_post.parametrizations.weight.original0"].mul_(CONV_POST_GAIN)
    torch.save(hift_state, out_dir / "hift.pt")

    # from_pretrained needs a weights file next to config.json; the released one is bf16. The embedding is
    # left out (too big to be worth it here): llm.pt overwrites every parameter anyway.
    prefix = "llm.model.model."
    placeholder = {"model." + key[len(prefix):]: value.to(torch.bfloat16).contiguous()
                   for key, value in llm_state.items()
                   if key.startswith(prefix) and not key.endswith("embed_tokens.weight")}
    save_file(placeholder, out_dir / TOKENIZER_DIR / "model.safetensors", metadata={"format": "pt"})


# ----------------------------------------------------------------------------- entry points


def make_tiny_bundle(out_dir: str | Path, seed: int = 0, dims: TinyDims = TinyDims()) -> Path:
    """Write the bundle into ``out_dir`` (created if needed, files overwritten) and validate it."""
    out_dir = Path(out_dir)
    qwen_dir = out_dir / TOKENIZER_DIR
    qwen_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cosyvoice3.yaml").write_text(_YAML.format(seed=seed, d=dims), encoding="utf-8")
    for name, content in qwen_files(dims).items():
        (qwen_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False), encoding="utf-8")
    train_tokenizer(qwen_dir)
    onnx.save(speech_tokenizer_onnx(_generator(seed, "speech_tokenizer"), dims.tokenizer_channels),
              out_dir / "speech_tokenizer_v3.onnx")
    onnx.save(campplus_onnx(_generator(seed, "campplus"), dims.campplus_hidden), out_dir / "campplus.onnx")
    _write_checkpoints(out_dir, seed)
    validate_model_dir(out_dir)
    return out_dir


def model_dir_or_demo(model_dir: str | Path | None, demo_dir: str | Path = DEMO_MODEL_DIR) -> tuple[str | Path, bool]:
    """The model to load and whether it is the demo: ``model_dir`` as given (a folder or a ModelScope id);
    without one the repository's model folder, or where that is missing a tiny random model generated (once)
    into ``demo_dir``, so that the web UI and the command lines still run on a fresh clone, saying loudly
    that their audio is noise."""
    if model_dir is not None:
        return model_dir, False
    if DEFAULT_MODEL_DIR.is_dir():
        return DEFAULT_MODEL_DIR, False
    logger.warning("\n%s\n%s\n%s", "!" * 100, DEMO_WARNING, "!" * 100)
    demo_dir = Path(demo_dir)
    try:
        validate_model_dir(demo_dir)
    except ModelBundleError:
        logger.warning("writing the demo model to %s", demo_dir)
        # written beside it and renamed into place: a second process starting at once (two CLIs, a server and a
        # CLI) never loads a half-written bundle; the loser of the rename drops its copy
        demo_dir.parent.mkdir(parents=True, exist_ok=True)
        partial = make_tiny_bundle(Path(tempfile.mkdtemp(prefix=f"{demo_dir.name}.", dir=demo_dir.parent)), seed=0)
        try:
            partial.rename(demo_dir)
        except OSError:  # a folder is there: another process's complete bundle, or one left incomplete
            try:
                validate_model_dir(demo_dir)
            except ModelBundleError:
                aside = Path(tempfile.mkdtemp(prefix=f"{demo_dir.name}.broken.", dir=demo_dir.parent))
                demo_dir.rename(aside / demo_dir.name)
                partial.rename(demo_dir)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                shutil.rmtree(partial, ignore_errors=True)
    return demo_dir, True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random value in the bundle")
    args = parser.parse_args(argv)
    print(make_tiny_bundle(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
