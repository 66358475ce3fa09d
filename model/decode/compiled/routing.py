"""Which compiled graph serves a step of n rows: the row classes, and the table a step looks its class up in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowClass:
    """Steps of `fewest` rows or more (up to the next class's fewest) run one graph, traced with `fewest` as
    the row count's size hint, so that its loops are split over threads where that many rows pay for it."""

    fewest: int
    name: str

    @property
    def scratch_rows(self) -> int:
        """Rows of the scratch state it is traced on: a hint stands in for more (no state of that size made)."""
        return min(self.fewest, 2)

    @property
    def hinted(self) -> bool:
        """Traced with a size hint: an optional class, whose rows a class of fewer rows serves without it."""
        return self.fewest > self.scratch_rows


ONE_ROW = RowClass(1, "1 row")
FEW_ROWS = RowClass(2, "2 or more rows")
# A graph traced for many rows splits loops that do not pay for their threads' start and join at few rows:
# at 2 and 8 rows it ran slower, at 48 and 64 faster (benchmarks/results/NOTES.md, "Row classes"); where between
# them it starts to pay was not measured finely.
MANY_ROWS = RowClass(48, "48 or more rows")
ROW_CLASSES = (FEW_ROWS, ONE_ROW, MANY_ROWS)  # compile order: the most used first


class RowRoutes:
    """The row classes whose graphs are ready, and for each row count the class whose graphs serve it."""

    def __init__(self, batch_size: int):
        self.ready: set[int] = set()  # the `fewest` of the row classes whose graphs are compiled
        self._class_by_rows: list[int | None] = [None] * (batch_size + 1)

    def class_for(self, rows: int) -> int | None:
        """The `fewest` of the ready row class that serves `rows` rows: the most rows' class that takes them
        (while a class is compiling, one of fewer rows takes its steps); None: none ready, or failed."""
        if not 0 <= rows < len(self._class_by_rows):
            return None
        return self._class_by_rows[rows]

    def reroute(self, failed: bool) -> None:
        """`class_for`'s table, made again whenever a class compiles or a compile fails (a step looks its
        class up rather than searching for it)."""
        self._class_by_rows = [self._serving_class(n, failed) for n in range(len(self._class_by_rows))]

    def _serving_class(self, rows: int, failed: bool) -> int | None:
        if failed or rows == 0:
            return None
        if rows == 1:
            return 1 if 1 in self.ready else None
        return max((c for c in self.ready if 2 <= c <= rows), default=None)
