"""The official model's fixed random buffers, replayed bit-exactly with a private generator.

The official constructors draw two inference-time noise buffers from torch's global CPU
generator right after ``CausalConditionalCFM.__init__`` reseeds it with 0:

1. the CFM initial noise ``randn(1, 80, 15000)`` (the first draw after the reseed), and
2. SineGen2's ``rand_ini`` (initial harmonic phases) and ``sine_waves`` (uniform noise, 300 s),
   drawn after every module built in between has consumed its random initialisation:
   flow ``nn.Embedding(vocab, input_size)`` and ``nn.Linear(spk_embed_dim, output_size)``,
   then the f0 predictor's five convolutions and its classifier.

Only the *number and kind* of those intermediate draws matter, so we repeat the same
``normal_`` / ``kaiming_uniform_`` / ``uniform_`` calls on throw-away tensors of the same
shapes. Everything runs on a private ``torch.Generator``; the global RNG is never touched.

``sine_waves`` is 7.2M x 9 floats (259 MB) but a call consumes only ``n_samples`` from
sample 0. torch's CPU ``uniform_`` draws one 32-bit value per float32 element, serially, so
any prefix can be produced on its own and continued later from the generator's state; we
keep one growing prefix per recipe (see :class:`_SineWavesReplay`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from cosyvoice.config import CosyVoice3Config, HiFTConfig
from cosyvoice.errors import ResourceLimitError

OFFICIAL_SEED = 0
CFM_NOISE_SHAPE = (1, 80, 50 * 300)  # the reference hard-codes 80 channels and 300 s at 50 frames/s
SINE_WAVES_SAMPLES = 300 * 24000  # the reference hard-codes 300 s at 24 kHz, whatever the sampling rate
F0_PREDICTOR_KERNELS = (4, 3, 3, 3, 3)  # CausalConvRNNF0Predictor: one look-ahead conv, four causal convs

_HASH_CHUNK_SAMPLES = 1 << 20
_MIN_GROWTH_SAMPLES = 24000 * 30


@dataclass(frozen=True)
class SineGenRecipe:
    """The dims that decide how many random numbers are drawn before SineGen2's buffers.

    Defaults are the released Fun-CosyVoice3-0.5B values; build it with :meth:`from_config`
    so a bundle with other dims replays its own sequence.
    """

    cond_channels: int = 512
    f0_in_channels: int = 80
    f0_num_class: int = 1
    nb_harmonics: int = 8
    flow_vocab_size: int = 6561
    flow_input_size: int = 80
    flow_spk_embed_dim: int = 192
    flow_output_size: int = 80

    @classmethod
    def from_config(cls, cfg: CosyVoice3Config) -> SineGenRecipe:
        """Everything from the bundle's yaml (flow and f0 predictor dims)."""
        f0 = cfg.hift.f0_predictor
        return cls(
            cond_channels=f0.cond_channels, f0_in_channels=f0.in_channels, f0_num_class=f0.num_class,
            nb_harmonics=cfg.hift.nb_harmonics, flow_vocab_size=cfg.flow.vocab_size,
            flow_input_size=cfg.flow.input_size, flow_spk_embed_dim=cfg.flow.spk_embed_dim,
            flow_output_size=cfg.flow.output_size)

    @classmethod
    def from_hift_config(cls, cfg: HiFTConfig) -> SineGenRecipe:
        """Vocoder dims only; the flow dims keep their released values (6561 tokens, 80 mels, 192-dim speaker)."""
        f0 = cfg.f0_predictor
        return cls(cond_channels=f0.cond_channels, f0_in_channels=f0.in_channels, f0_num_class=f0.num_class,
                   nb_harmonics=cfg.nb_harmonics)

    @property
    def n_harmonics(self) -> int:
        """Channels of both buffers: the fundamental plus ``nb_harmonics`` overtones."""
        return self.nb_harmonics + 1


# ----------------------------------------------------------------------------- replaying default initialisers


def _skip_embedding_init(g: torch.Generator, num_embeddings: int, dim: int) -> None:
    """``nn.Embedding.reset_parameters``: standard normal weight."""
    nn.init.normal_(torch.empty(num_embeddings, dim), generator=g)


def _skip_affine_init(g: torch.Generator, weight_shape: tuple[int, ...]) -> None:
    """``nn.Linear`` / ``nn.Conv1d.reset_parameters``: kaiming-uniform weight, then a uniform bias."""
    weight = torch.empty(weight_shape)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=g)
    fan_in = math.prod(weight_shape[1:])
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(torch.empty(weight_shape[0]), -bound, bound, generator=g)


def _draw_cfm_noise(g: torch.Generator) -> torch.Tensor:
    return torch.randn(CFM_NOISE_SHAPE, generator=g, dtype=torch.float32)


def _generator_after_reseed() -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(OFFICIAL_SEED)


def _replay_to_sinegen(recipe: SineGenRecipe) -> tuple[torch.Tensor, torch.Generator]:
    """Replay every draw from the reseed to ``rand_ini``; return it and the generator positioned at ``sine_waves``."""
    g = _generator_after_reseed()
    _draw_cfm_noise(g)
    _skip_embedding_init(g, recipe.flow_vocab_size, recipe.flow_input_size)
    _skip_affine_init(g, (recipe.flow_output_size, recipe.flow_spk_embed_dim))
    in_channels = recipe.f0_in_channels
    for kernel in F0_PREDICTOR_KERNELS:
        _skip_affine_init(g, (recipe.cond_channels, in_channels, kernel))
        in_channels = recipe.cond_channels
    _skip_affine_init(g, (recipe.f0_num_class, recipe.cond_channels))
    rand_ini = torch.rand(1, recipe.n_harmonics, generator=g, dtype=torch.float32)
    rand_ini[:, 0] = 0.0  # the fundamental starts at phase 0
    return rand_ini, g


# ----------------------------------------------------------------------------- cached buffers


class _SineWavesReplay:
    """One recipe's ``rand_ini`` and a growing prefix of ``sine_waves``, extended on demand."""

    def __init__(self, recipe: SineGenRecipe) -> None:
        self.recipe = recipe
        self.rand_ini, self._generator = _replay_to_sinegen(recipe)
        self.start_state = self._generator.get_state()
        self._prefix = torch.empty(1, 0, recipe.n_harmonics, dtype=torch.float32)
        self._lock = threading.Lock()

    def prefix(self, n_samples: int) -> torch.Tensor:
        """``sine_waves[:, :n_samples]`` (a view of the cache: do not modify it)."""
        _check_length(n_samples)
        with self._lock:
            have = self._prefix.shape[1]
            if n_samples > have:
                # grow geometrically so a streaming session's ever longer calls cost linear time overall
                target = min(SINE_WAVES_SAMPLES, max(n_samples, 2 * have, _MIN_GROWTH_SAMPLES))
                more = torch.rand(1, target - have, self.recipe.n_harmonics, generator=self._generator,
                                  dtype=torch.float32)
                self._prefix = torch.cat([self._prefix, more], dim=1)
            return self._prefix[:, :n_samples]


_REPLAYS: dict[SineGenRecipe, _SineWavesReplay] = {}
_REPLAYS_LOCK = threading.Lock()


def _replay(recipe: SineGenRecipe) -> _SineWavesReplay:
    with _REPLAYS_LOCK:
        if recipe not in _REPLAYS:
            _REPLAYS[recipe] = _SineWavesReplay(recipe)
        return _REPLAYS[recipe]


def _check_length(n_samples: int) -> None:
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    if n_samples > SINE_WAVES_SAMPLES:
        raise ResourceLimitError(
            f"the vocoder's fixed noise buffer covers {SINE_WAVES_SAMPLES} samples (300 s at 24 kHz, as in the "
            f"official model); {n_samples} were requested: synthesise shorter segments")


def _as_recipe(recipe: SineGenRecipe | int) -> SineGenRecipe:
    return recipe if isinstance(recipe, SineGenRecipe) else SineGenRecipe(cond_channels=recipe)


@functools.cache
def _cached_cfm_noise() -> torch.Tensor:
    return _draw_cfm_noise(_generator_after_reseed())


def cfm_noise() -> torch.Tensor:
    """The flow's fixed initial noise ``[1, 80, 15000]`` (float32, CPU); a fresh copy per call."""
    return _cached_cfm_noise().clone()


def sinegen_rand_ini(recipe: SineGenRecipe | int) -> torch.Tensor:
    """SineGen2's initial phases ``[1, nb_harmonics + 1]`` (entry 0 is 0); an int means ``cond_channels``."""
    return _replay(_as_recipe(recipe)).rand_ini.clone()


def sinegen_sine_waves(recipe: SineGenRecipe | int, n_samples: int) -> torch.Tensor:
    """The first ``n_samples`` of SineGen2's noise buffer, ``[1, n_samples, nb_harmonics + 1]``, read-only view."""
    return _replay(_as_recipe(recipe)).prefix(n_samples)


def sinegen_buffers(recipe: SineGenRecipe | int, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rand_ini, sine_waves[:, :n_samples])`` as the official vocoder for this recipe holds them."""
    return sinegen_rand_ini(recipe), sinegen_sine_waves(recipe, n_samples)


def sine_waves_sha256(recipe: SineGenRecipe | int, n_samples: int = SINE_WAVES_SAMPLES) -> str:
    """sha256 of the float32 bytes of ``sine_waves[:, :n_samples]``, generated in chunks (no 259 MB tensor)."""
    _check_length(n_samples)
    replay = _replay(_as_recipe(recipe))
    g = torch.Generator(device="cpu")
    g.set_state(replay.start_state)
    digest = hashlib.sha256()
    done = 0
    while done < n_samples:
        step = min(_HASH_CHUNK_SAMPLES, n_samples - done)
        chunk = torch.rand(1, step, replay.recipe.n_harmonics, generator=g, dtype=torch.float32)
        digest.update(memoryview(chunk.numpy()).cast("B"))
        done += step
    return digest.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's contiguous CPU bytes, the way the golden fixtures hash their buffers."""
    return hashlib.sha256(memoryview(t.detach().cpu().contiguous().numpy()).cast("B")).hexdigest()
