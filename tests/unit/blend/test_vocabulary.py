"""Blend's selection rules and ratio: one definition, one check."""

import math

import pytest

from ucm.config import BLEND_SELECTIONS, HKVD_SELECTION, ORACLE_SELECTION, QUERY_SELECTION
from ucm.sparse.blend.vocabulary import Selection, check_ratio, is_ratio


def test_public_names_are_the_rules_labels():
    assert BLEND_SELECTIONS == ("query", "hkvd", "oracle", "key_l1", "key_l2", "chunk_start")
    assert [Selection.parse(n) for n in (QUERY_SELECTION, HKVD_SELECTION, ORACLE_SELECTION)] == list(Selection)[:3]
    assert Selection.parse("HKVD") is None and Selection.parse(1) is None


@pytest.mark.parametrize("value", [0, 1, 0.15, 1.0])
def test_ratios(value):
    assert is_ratio(value) and check_ratio(value) == float(value)


@pytest.mark.parametrize("value", [True, -0.1, 1.01, math.nan, math.inf, "0.5", None])
def test_not_ratios_name_what_was_given(value):
    assert not is_ratio(value)
    with pytest.raises(ValueError, match=r"ucm_blend_ratio must be a number in \[0, 1\], got"):
        check_ratio(value, "ucm_blend_ratio")
