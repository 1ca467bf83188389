"""What features ask of the service's loaded model (:class:`~cosyvoice.pipeline.Model`), so that nothing outside the
service reaches into it: its folder, what it computes in, its default flow steps, how it splits and counts text; and
closing it. A base of :class:`cosyvoice.service.TTSService`.
"""

from __future__ import annotations

from cosyvoice.backends.precision import PrecisionPlan
from cosyvoice.pipeline import Model


class ServiceModel:
    """Answers about ``model``."""

    model: Model

    @property
    def model_dir(self) -> str:
        return self.model.model_dir

    @property
    def precision(self) -> PrecisionPlan:
        """What the LLM and the DiT compute in (its ``label`` is what takes record and pages show)."""
        return self.model.plan

    @property
    def default_steps(self) -> int:
        """The flow's Euler steps of a request that names none (the model's ``n_timesteps``)."""
        return self.model.engine.default_steps

    def split_text(self, text: str) -> list[str]:
        """``text`` normalised and split into the pieces the model reads, one request each (the frontend's split)."""
        return self.model.frontend.text.split(text)

    def count_text_tokens(self, text: str) -> int:
        """How many LLM text tokens ``text`` is (as the LLM counts it for its length bounds)."""
        return len(self.model.frontend.encode(text))

    def close(self) -> None:
        """Stop the engine's threads and free the model (the service takes no requests after)."""
        self.model.close()
