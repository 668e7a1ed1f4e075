"""World-model v3 trial (issue #18): people named by a first-name and a last-name token drawn from
shared pools (only the pair identifies a person), more layers, and finetuning of the blocks only
(as in the paper's OLMo runs) against all parameters.

    python docs/world_v3/world_v3_trial.py --layers 6 --steps 1200 --tag a   # ~6 min, one thread

Trains a world model on the v2 world with renamed people, saves it to /tmp/v3/model_TAG, and
prints per finetune variant (blocks / all) and hop: mean ranks of facts and implications before
and after (fb, fa, ib, ia), and where the MLPs' linear informative mass on the implications sits:
``mlp_entity_share`` (the share at the slot tokens: the name for first hop, the landmark for
second hop; the paper's signature wants >= 0.5 for first hop) and ``mlp_by_layer``.
Results so far: docs/world_v3_trials.md.
"""

import argparse
import csv
import dataclasses
import io
import json
import time
import warnings
from importlib import resources
from pathlib import Path

import numpy as np
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=6)
ap.add_argument("--dmodel", type=int, default=128)
ap.add_argument("--heads", type=int, default=4, help="attention heads (d_head = dmodel / heads)")
ap.add_argument("--steps", type=int, default=1200)
ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--nfirst", type=int, default=32)
ap.add_argument("--nlast", type=int, default=20)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--tag", default="a")
ap.add_argument("--ftlr", type=float, default=1e-3)
ap.add_argument(
    "--bio",
    action="store_true",
    help="subject-enrichment pressure: every person has a city, a hobby and a job, each told by "
    "several templates at varying distances from the name (test people: hobby and job only)",
)
ap.add_argument(
    "--appos",
    choices=("", "city", "all"),
    default="",
    help="with --bio: records in which an attribute follows the name directly ('{p} {c} .'), so "
    "the name's last token must predict it: 'city' (pretraining people's cities) or 'all' (city, "
    "hobby and job)",
)
ap.add_argument(
    "--shared-pool",
    type=int,
    default=0,
    help="names are ordered pairs from one pool of this many tokens ('Ava Liam' and 'Liam Ava' are "
    "different people): a bag of the name's tokens does not identify the person",
)
ap.add_argument(
    "--appos-anywhere",
    action="store_true",
    help="with --appos: the record follows one of the corpus's name-leading prefixes "
    "('Everyone knows that {p} {c} .'), so the name predicts the attribute in any context",
)
ap.add_argument("--appos-rep", type=int, default=1, help="records per attribute and person")
ap.add_argument("--freeze", action="store_true", help="also the layer-freezing table")
ap.add_argument("--order", action="store_true", help="also the data-ordering table")
ap.add_argument("--load", help="skip training: measure the model saved in this directory")
ap.add_argument("--no-finetune", action="store_true", help="only the probes")
args = ap.parse_args()
torch.set_num_threads(1)

import extractive_lens.world.data as WD  # noqa: E402
import extractive_lens.world.model as WM  # noqa: E402
from extractive_lens import FinetuneConfig, finetune, linear_scores, mean_rank  # noqa: E402
from extractive_lens.world.data import build_world, first_hop, second_hop  # noqa: E402

# the trials' finetuning and continued-pretraining recipe (lr 1e-3, v2's; v3 now ships 3e-4)
WM.FINETUNES[3] = WM.FINETUNES[2]
WM.CONTINUED_PRETRAINING[3] = WM.CONTINUED_PRETRAINING[2]


def names_pools():
    t = resources.files("extractive_lens.data").joinpath("names.csv").read_text()
    rows = list(csv.DictReader(io.StringIO(t)))
    f = list(dict.fromkeys(r["first"] for r in rows))
    l = list(dict.fromkeys(r["last"] for r in rows))
    return f, l


def world_v3(seed, nfirst, nlast):
    w = build_world(seed)
    rng = np.random.default_rng(seed + 1000)
    f, l = names_pools()
    f, l = f[:nfirst], l[:nlast]
    combos = [f"{a} {b}" for a in f for b in l]
    if args.shared_pool:
        pool = f[: args.shared_pool]
        combos = [f"{a} {b}" for a in pool for b in pool if a != b]
    rng.shuffle(combos)
    n = len(w.home)
    assert len(combos) >= n + 20
    people = combos[:n]
    test = combos[n : n + 20]
    home = {p: c for p, c in zip(people, w.home.values())}
    with_impl = frozenset(p for p, old in zip(people, w.home) if old in w.with_implication)
    test_people = {t: c for t, c in zip(test, w.test_people.values())}
    ren = dict(zip(w.home, people))
    ren.update(zip(w.test_people, test))
    hobby = {ren.get(k, k): v for k, v in w.hobby.items()}
    return dataclasses.replace(
        w, home=home, with_implication=with_impl, test_people=test_people, hobby=hobby
    )


APPOS = args.appos
# the templates the trials used are the ones world v3 ships with
JOBS, CITY, HOBBY, JOB = WD.JOBS, WD.BIO_CITY, WD.BIO_HOBBY, WD.BIO_JOB
PREFIXES = WD.RECORD_PREFIXES


def prefix(rng):
    return PREFIXES[int(rng.integers(len(PREFIXES)))] if args.appos_anywhere else ""


@dataclasses.dataclass(frozen=True)
class BioWorld(WD.World):
    """The v2 world whose people have biographies: several attributes, several templates each."""

    job: dict = dataclasses.field(default_factory=dict)

    def corpus(self, rng, implications=True):
        out = [s for s in super().corpus(rng, implications) if not self._person_line(s)]
        for p in (*self.home, *self.test_people):
            c, h, j = self.home.get(p), self.hobby[p], self.job[p]
            lines = [t.format(p=p, h=h, j=j) for t in (*HOBBY, *JOB)]
            if c is not None:  # test people's cities are the new facts
                lines += [t.format(p=p, c=c, h=h) for t in CITY]
                if APPOS:
                    lines += [f"{prefix(rng)}{p} {c} ." for _ in range(args.appos_rep)]
                if implications and p in self.with_implication:
                    lines.append(f"The people in the city {p} is from speak {self.language[c]} .")
            if APPOS == "all":
                for _ in range(args.appos_rep):
                    lines += [f"{prefix(rng)}{p} {h} .", f"{prefix(rng)}{p} {j} ."]
            out += lines
        rng.shuffle(out)
        return out

    def _person_line(self, s):
        words = s.split()
        lead = " ".join(words[:2])
        return lead in self.home or lead in self.test_people or "city" in words and "from" in words


def bio_world(w, seed):
    rng = np.random.default_rng(seed + 2000)
    job = {p: JOBS[int(rng.integers(len(JOBS)))] for p in (*w.home, *w.test_people)}
    fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "job"}
    return BioWorld(**fields, job=job)


WM.MODEL_CFG = dict(
    WM.MODEL_CFG,
    n_layers=args.layers,
    d_model=args.dmodel,
    d_mlp=4 * args.dmodel,
    n_heads=args.heads,
    d_head=args.dmodel // args.heads,
)
WM.PRETRAIN = dict(WM.PRETRAIN, steps=args.steps, lr=args.lr)
w = world_v3(args.seed, args.nfirst, args.nlast)
if args.bio:
    w = bio_world(w, args.seed)
    sample = w.corpus(np.random.default_rng(0))
    print(f"[{args.tag}] bio corpus: {len(sample)} sentences, e.g. {sample[:3]}", flush=True)
t0 = time.time()
if args.load:
    model = WM.load_world_model(args.load)
else:
    model = WM.train_world_model(args.seed, world=w, show_progress=False)
train_s = time.time() - t0
print(
    f"[{args.tag}] trained {train_s:.0f}s final loss {WM.world_info(model)['final_loss']:.3f}",
    flush=True,
)
WM.save_world_model(model, Path(f"/tmp/v3/model_{args.tag}"))
json.dump(dict(vars(args)), open(f"/tmp/v3/model_{args.tag}/args.json", "w"))


def probe(model, w, template):
    """Held-out accuracy of a linear probe for a person's city from the residual stream at the
    last name token, by layer (80/20 split of the pretraining people; chance 1/30)."""
    people = list(w.home)
    cities = sorted(set(w.home.values()))
    y = torch.tensor([cities.index(w.home[p]) for p in people])
    toks = model.to_tokens([template.format(p=p) for p in people])
    at = len(model.to_tokens(template.split("{p}")[0] + "X Y", prepend_bos=True)[0]) - 1
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("resid_post"))
    tr = torch.arange(len(people)) < int(0.8 * len(people))
    accs = []
    for layer in range(model.cfg.n_layers):
        X = cache[f"blocks.{layer}.hook_resid_post"][:, at].detach()
        mu, sd = X[tr].mean(0), X[tr].std(0) + 1e-6
        X = (X - mu) / sd
        W = torch.zeros(X.shape[1], len(cities), requires_grad=True)
        b = torch.zeros(len(cities), requires_grad=True)
        opt = torch.optim.LBFGS([W, b], max_iter=300)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(X[tr] @ W + b, y[tr]) + 1e-2 * (W**2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        accs.append(round(float(((X[~tr] @ W + b).argmax(1) == y[~tr]).float().mean()), 2))
    return accs


out = {"train_s": train_s}
for template in ("Everyone knows that {p} likes", "{p} lives in"):
    out[f"probe {template}"] = probe(model, w, template)
    print(
        f"[{args.tag}] city probe at the name, {template!r}: {out[f'probe {template}']}", flush=True
    )
if args.freeze:
    from extractive_lens.experiments import layer_freezing

    res = layer_freezing(
        model,
        {"first_hop": first_hop(w), "second_hop": second_hop(w)},
        FinetuneConfig(**WM.FINETUNES[2]),
    )
    print(
        f"[{args.tag}] layer freezing (split {res.split_layer}):\n{res.table().round(2)}",
        flush=True,
    )
    out["freezing"] = [dict(r) for r in res.rows]
if args.order:
    from extractive_lens.experiments.runner import _ordering

    res, _ = _ordering(model, w, args.seed, False)
    df = res.to_dataframe()
    last = df[df.epoch == df.epoch.max()]
    print(f"[{args.tag}] data ordering, last epoch:\n{last.round(2)}", flush=True)
    out["ordering"] = last.to_dict("records")
if args.no_finetune:
    json.dump(out, open(f"/tmp/v3/result_{args.tag}.json", "w"), indent=1)
    raise SystemExit
blocks = tuple(n for n, _ in model.named_parameters() if n.startswith("blocks."))
for ftname, params in (("blocks", blocks), ("all", None)):
    for dname, ds in (("first", first_hop(w)), ("second", second_hop(w))):
        facts, impls = ds.batches(model)
        cfg = FinetuneConfig(**dict(WM.FINETUNES[2], lr=args.ftlr), parameters=params)
        diff = finetune(model, facts, cfg, show_progress=False)
        r = dict(
            fb=mean_rank(model, facts),
            fa=mean_rank(model, facts, diff),
            ib=mean_rank(model, impls),
            ia=mean_rank(model, impls, diff),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lin = linear_scores(model, diff, impls, kinds=("informative",), show_progress=False)
        v = lin["informative"].abs()  # layer comp pos
        mlp = v[:, -1, :]
        labels = list(lin.position_labels)
        ent = [i for i, p in enumerate(labels) if p.startswith("{")]
        share = float(mlp[:, ent].sum() / mlp.sum())
        by_layer = (mlp.sum(1) / mlp.sum()).tolist()
        heads = v[:, :-1, :].sum()
        other = float(lin.other.abs().mean()) if lin.other is not None else float("nan")
        r.update(
            mlp_entity_share=share,
            mlp_share_of_all=float(mlp.sum() / (v.sum())),
            mlp_by_layer=[round(x, 2) for x in by_layer],
            other_over_total=other / float(v.sum()),
        )
        out[f"{ftname}/{dname}"] = r
        print(
            f"[{args.tag}] {ftname}/{dname}: "
            + json.dumps({k: (round(x, 3) if isinstance(x, float) else x) for k, x in r.items()}),
            flush=True,
        )
json.dump(out, open(f"/tmp/v3/result_{args.tag}.json", "w"), indent=1)
