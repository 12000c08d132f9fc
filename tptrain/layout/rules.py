"""The one rule table: every refusal of a layout, decided once, with one message.

    validate(Case(dims=dims, features=Features(sequence_parallel=True), facts=model_facts(model)))
    resolve(4, tp_size=2)                      # the sizes against the world size: the size rules
    check("cp_seq_len", cp=2, seq_len=9)       # one row, asked of the values it reads (the Case built here)

The rows, in the order they are checked (the first refused raises its ValueError): the sizes as given
(size_rules.py), which axes and features compose with each other and with the model (axis_rules.py), and what a
training run or an input brings (training_rules.py). A row whose inputs are not known where the table is checked
(a batch size in `from_pretrained`, a world size in `tptrain plan`) waits for an entry point that knows them; the
library (`from_pretrained`, `model.parallelize`), the Trainer, `tptrain train`'s checks before any worker starts and
`tptrain plan` all check the same table. `docs/parallelism.md` shows it (table.py renders it; a test compares).

Pure: imports no torch.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from tptrain.layout import axis_rules, size_rules, training_rules
from tptrain.layout.case import LIBRARY, Case, Features, ModelFacts, Rule, Spelling
from tptrain.layout.dims import SPELLING_AXES, Asked, ParallelDims

RULES: tuple[Rule, ...] = (*size_rules.ROWS, *axis_rules.ROWS, *training_rules.ROWS)
_BY_NAME = {r.name: r for r in RULES}
assert len(_BY_NAME) == len(RULES), "rule names are unique"


def refusals(case: Case) -> list[tuple[str, str]]:
    """(rule name, message) of every row that refuses `case`, in table order."""
    return [(r.name, message) for r in RULES if (message := r.refusal(case)) is not None]


def validate(case: Case) -> None:
    """ValueError with the message of the first row that refuses `case` (the same on every rank: nothing here
    communicates)."""
    for r in RULES:
        message = r.refusal(case)
        if message is not None:
            raise ValueError(message)


def check(name: str, case: Case | None = None, /, **values: Any) -> None:
    """ValueError if the row `name` refuses `case`, or the Case of `values` (`case_of`), where only that row's inputs
    are at hand: `check("cp_seq_len", cp=2, seq_len=9)`."""
    row = _BY_NAME[name]
    if case is None:
        case = case_of(**values)
        assert all(case.known(path) for path in row.needs), f"rule {name!r} reads {row.needs}, given {values}"
    message = row.refusal(case)
    if message is not None:
        raise ValueError(message)


_DIMS, _FEATURES, _FACTS = ({f.name for f in fields(kind)} for kind in (ParallelDims, Features, ModelFacts))
_CASE = {f.name for f in fields(Case)} - {"dims", "features", "facts"}


def case_of(**values: Any) -> Case:
    """The Case of `values`, each an input under its own name: a size (tp=, cp=, pp=, ep=, dp_shard=, dp_replicate=;
    the others 1, none given: the sizes not known), a feature (seq_len=, pp_layers=, sequence_parallel=, ...), a fact
    of the model (name= its class, model_type=, num_layers=, experts=, ...; those not given "" or the default, none
    given: the model not known) or the Case's own (asked=, world=, spelling=, ...)."""
    unknown = set(values) - _DIMS - _FEATURES - _FACTS - _CASE
    assert not unknown, f"not an input of the rule table: {sorted(unknown)}"
    dims, features, facts, own = ({k: v for k, v in values.items() if k in names}
                                  for names in (_DIMS, _FEATURES, _FACTS, _CASE))
    return Case(dims=ParallelDims(**dims) if dims else None, features=Features(**features),
                facts=ModelFacts(**{"name": "", "model_type": "", **facts}) if facts else None, **own)


def resolve(world: int, *, features: Features | None = None, spelling: Spelling = LIBRARY,
            **sizes: Any) -> ParallelDims:
    """The sizes (tp_size=, cp_size=, ep_size=, dp_replicate_size=, dp_shard_size=, pp_size=; None: tp and dp_shard
    take what `world` leaves over) resolved against `world`, after the rows of the table that read the sizes as
    given (and `features`, what else is asked: e.g. enable_expert_parallel); a ValueError naming the sizes as
    `spelling` spells them."""
    asked = Asked(**{k: v for k, v in sizes.items() if v is not None or k in ("tp_size", "ep_size", "dp_shard_size")})
    validate(Case(asked=asked, world=world, features=features or Features(), spelling=spelling))
    return asked.solve(world)


def parse_layout(text: str, world: int) -> ParallelDims:
    """`--layout tp=2,cp=2,pp=2,dp_shard=2,dp_replicate=1,ep=2` (tptrain plan --train, tptrain train --layout):
    omitted sizes are 1, except dp_shard, which takes the rest of `world` when omitted. ValueError naming the bad
    part; the sizes against `world` are the table's rows (the same refusals, spelled as the --layout's axes)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        axis, _, value = (x.strip() for x in part.partition("="))
        if axis not in SPELLING_AXES or not value.lstrip("-").isdigit():
            raise ValueError(f"--layout {text!r}: {part!r} is not AXIS=SIZE with AXIS one of "
                             f"{', '.join(SPELLING_AXES)} and SIZE a positive integer (e.g. tp=2,cp=2,pp=2)")
        if axis in sizes:
            raise ValueError(f"--layout {text!r} gives {axis} twice")
        sizes[axis] = int(value)
    given = {f"{axis}_size": sizes.get(axis, 1) for axis in SPELLING_AXES if axis != "dp_shard"}
    return resolve(world, spelling=Spelling(described=f"--layout {text!r}", layout=text),
                   dp_shard_size=sizes.get("dp_shard"), **given)
