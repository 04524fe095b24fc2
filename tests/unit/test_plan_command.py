"""``xreduced plan``'s arguments, in process: what makes no plan is refused with exit status 2."""

from __future__ import annotations

import pytest
from xreduce import SUPPORTED_DTYPES
from xreduced import cli


@pytest.mark.parametrize("dtype", ["str", "object", "U4", "bool", "S3", "datetime64", "float128", "nope"])
def test_only_the_wires_dtypes_make_a_plan(dtype, capsys):
    with pytest.raises(SystemExit) as e:
        cli.plan(["--devices", "2", "--bytes", "16", "--dtype", dtype])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (f"argument --dtype: {dtype!r} is not a dtype the daemon reduces; use one of "
            f"{', '.join(SUPPORTED_DTYPES)}") in captured.err


@pytest.mark.parametrize(("dtype", "elements"), [("float32", 4), ("f4", 4), ("bfloat16", 8), ("complex128", 1)])
def test_the_wires_dtypes_and_numpys_names_for_them_make_a_plan(dtype, elements, capsys):
    assert cli.plan(["--devices", "2", "--bytes", "16", "--dtype", dtype]) == 0
    assert f"pack 0 ({elements} elements, 16 B)" in capsys.readouterr().out
