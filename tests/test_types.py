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


def test_hook_names_select_the_component_in_a_transformer_lens_cache():
    import torch

    from extractive_lens import tiny_model
    from extractive_lens.model import W_O

    m = tiny_model({"n_layers": 2, "dtype": torch.float64})
    tokens = torch.tensor([[1, 5, 7, 9]])
    _, cache = m.run_with_cache(tokens)
    head, mlp = Component.parse("L1H2"), Component.parse("L0MLP")
    z = cache[head.hook_name][:, :, head.head]
    total = sum(cache["blocks.1.attn.hook_z"][:, :, h] @ W_O(m, 1)[h] for h in range(m.cfg.n_heads))
    assert torch.allclose(
        total + m.blocks[1].attn.b_O, cache["blocks.1.hook_attn_out"]
    )  # heads' writes add up
    assert z.shape == (1, 4, m.cfg.d_head) and (head.layer, head.head) == (1, 2)
    assert torch.equal(cache[mlp.hook_name], cache["blocks.0.hook_mlp_out"]) and mlp.head is None


def test_submodules_are_reachable_in_a_fresh_session():
    import subprocess
    import sys

    code = (
        "import extractive_lens as el; import sys; assert 'extractive_lens.plotting' not in sys.modules; "
        "print(el.plotting.report.__name__, el.world.load_world_model.__name__, el.experiments.layer_freezing.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["report", "load_world_model", "layer_freezing"]


def test_type_stub_lists_exactly_the_lazy_public_names():
    """``extractive_lens/__init__.pyi`` (what editors read, since the names are imported lazily)
    names every export from the module it really comes from, and every lazy submodule."""
    import ast
    from pathlib import Path

    import extractive_lens as el

    stub = ast.parse((Path(el.__file__).parent / "__init__.pyi").read_text())
    names: dict[str, str] = {}
    for node in stub.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert alias.asname == alias.name  # re-exported explicitly
                names[alias.name] = node.module or ""
    submodules = {n for n, m in names.items() if m == "extractive_lens"}
    exports = {n: m for n, m in names.items() if m != "extractive_lens"}
    assert exports == el._EXPORTS
    assert submodules == set(el._SUBMODULES)
    for name, module in exports.items():
        assert getattr(el, name) is getattr(__import__(module, fromlist=[name]), name)
