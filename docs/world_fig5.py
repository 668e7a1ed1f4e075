"""The paper's Fig. 5 on the bundled world model (README, notebook 02): MLP linear informative
scores of first-hop vs second-hop implications after finetuning on each hop's 20 test facts, one
colour scale. ``python docs/world_fig5.py [docs/world_fig5.png] [--html fig5.html]``."""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("png", nargs="?", default="docs/world_fig5.png")
    ap.add_argument("--html", default=None, help="also the interactive figure")
    ap.add_argument("--world", default=None, help="v2, v3 or a directory (default: the default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import extractive_lens as el
    from extractive_lens.world import load_world_model
    from extractive_lens.world.check import informative_by_hop

    by_hop = informative_by_hop(load_world_model(args.world))
    results = {name.replace("_", " "): lin for name, lin in by_hop.items()}
    fig = el.plotting.side_by_side(results)
    if args.html:
        fig.write_html(args.html, include_plotlyjs=True)
    fig.write_image(args.png, width=870, height=560)  # kaleido, headless Chromium
    print("wrote", args.png)


if __name__ == "__main__":
    main()
