"""benchmarks/train_step.py: the side-by-side training-step table, and a clear error for a bad kind."""

from __future__ import annotations

import re

import pytest

from benchmarks import train_step
from model.attention.kinds import attention_kinds


def test_table_has_one_row_per_kind_in_order_with_softmax_as_the_unit(capsys):
    assert train_step.main(["--kinds", "softmax,reformer", "--preset", "tiny", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| (softmax|reformer) \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["softmax", "reformer"]
    cells = [[cell.strip() for cell in row.split("|")[2:-1]] for row in rows]
    assert cells[0][2] == "1.00x" and cells[0][4] == "1.00x"  # softmax over itself
    wall, best = float(cells[1][0]), float(cells[1][1])
    assert 0 < best <= wall  # one timed step: the best is that step


def test_unknown_kind_is_refused_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_step.main(["--kinds", "softmax,performer"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "performer" in err and ",".join(attention_kinds()) in err
