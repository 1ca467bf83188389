"""What the Rust-backend parity tests share: reporting rows of :mod:`cosyvoice.tools.parity` comparisons.

Every row is printed (``pytest -s`` shows them; the README's parity table is made of these numbers) before the
test asserts that all of them passed.
"""

from __future__ import annotations

from cosyvoice.tools.parity.common import Result


def assert_rows(results: list[Result]) -> None:
    """Print each comparison row, then fail naming every row that missed its tolerance."""
    for result in results:
        print(result.row())
    failed = [result.row() for result in results if not result.passed]
    assert not failed, "\n".join(failed)
