"""Golden parity checks: our implementation against the official reference's fixtures."""

from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact

# Component modules, each exposing ``check(golden) -> list[Result]``, in data-flow order.
COMPONENTS: tuple[str, ...] = ("text", "frontend", "llm", "bistream", "flow", "hift", "t2w", "e2e")

__all__ = ["COMPONENTS", "Golden", "Result", "compare", "compare_exact"]
