import pytest

from extractive_lens.types import Component, iter_components, parse_components


def test_labels_round_trip():
    for c in iter_components(n_layers=3, n_heads=4):
        assert Component.parse(c.label) == c
    assert Component.parse("L3H2") == Component(3, 2)
    assert Component.parse("L10MLP") == Component(10, None)


def test_enumeration_order_heads_then_mlp():
    labels = [c.label for c in iter_components(n_layers=2, n_heads=2)]
    assert labels == ["L0H0", "L0H1", "L0MLP", "L1H0", "L1H1", "L1MLP"]
    assert [c.label for c in iter_components(1, 2, has_mlp=False)] == ["L0H0", "L0H1"]


@pytest.mark.parametrize("bad", ["L3", "H2", "L3H", "3H2", "L-1H0", "l3h2x"])
def test_bad_labels_say_what_to_write(bad):
    with pytest.raises(ValueError, match="L<layer>H<head>"):
        Component.parse(bad)


def test_selection_checked_against_model_shape():
    assert parse_components(["L0H1", "L1MLP"], 2, 2) == (Component(0, 1), Component(1, None))
    with pytest.raises(ValueError, match="only 2 layers"):
        parse_components(["L2H0"], 2, 2)
    with pytest.raises(ValueError, match="only 2 heads"):
        parse_components(["L0H2"], 2, 2)
    with pytest.raises(ValueError, match="attention-only"):
        parse_components(["L0MLP"], 2, 2, has_mlp=False)
