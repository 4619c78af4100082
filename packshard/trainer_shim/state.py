"""Resume state of a `PackedShardStream`: small, versioned, checked before it is used.

A state is a plain dict (JSON-able, ~0.5 KB) so it fits any checkpoint format (torch.save,
DCP's ``Stateful``, a JSON sidecar):

    {"version": 1, "kind": "packshard.PackedShardStream",
     "dataset": {"fingerprint", "num_rows"},
     "plan": {"seed", "shuffle", "epochs", "rows_per_step", "balance", "cost_model"},
     "topology": {"dp_rank", "dp_size", "cp_rank", "cp_size", "cp_layout"},
     "position": {"epoch", "offset", "step", "micro_step"}}

The position is global (the same on every rank: all ranks run the same micro-steps), so any
rank's state can restart any rank. ``offset`` counts the rows of the epoch consumed by the
completed steps (the step plan makes them a prefix of the epoch's order), ``micro_step`` the
micro-batches of step ``step`` already handed out.

Resuming rules (`check_resume`):
- the dataset fingerprint (the manifest's index checksum) and row count must match, and so
  must shuffle, and with shuffling the seed (they fix the row order): otherwise ValueError
  saying what differs;
- at a step boundary (``micro_step == 0``) dp_size, rows_per_step, balance, the cost model and
  the CP topology may all change (elastic resume): the remaining rows of the epoch are
  re-partitioned, none skipped or repeated;
- mid-step, only the CP topology may change (the step's split over DP ranks must stay the
  same): otherwise ValueError telling to checkpoint at a step boundary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

STATE_VERSION = 1
STATE_KIND = "packshard.PackedShardStream"


@dataclass(frozen=True)
class StreamState:
    """The resume state's fields (see the module docstring)."""

    fingerprint: str
    num_rows: int
    seed: int
    shuffle: bool
    epochs: int | None
    rows_per_step: int
    balance: str
    cost_model: tuple[float, float]
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    cp_layout: str
    epoch: int
    offset: int
    step: int
    micro_step: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {
            "version": STATE_VERSION,
            "kind": STATE_KIND,
            "dataset": {k: d[k] for k in ("fingerprint", "num_rows")},
            "plan": {
                **{k: d[k] for k in ("seed", "shuffle", "epochs", "rows_per_step", "balance")},
                "cost_model": list(self.cost_model),
            },
            "topology": {
                k: d[k] for k in ("dp_rank", "dp_size", "cp_rank", "cp_size", "cp_layout")
            },
            "position": {k: d[k] for k in ("epoch", "offset", "step", "micro_step")},
        }

    @classmethod
    def from_dict(cls, state: Any) -> StreamState:
        """Parse a state dict; ValueError naming what is wrong with it."""
        if not isinstance(state, dict):
            raise ValueError(
                f"a PackedShardStream state must be a dict, got {type(state).__name__}"
            )
        if state.get("kind") != STATE_KIND:
            raise ValueError(
                f"not a PackedShardStream state (kind={state.get('kind')!r}, expected {STATE_KIND!r})"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"PackedShardStream state version {state.get('version')!r} is not known to this trainer_shim "
                f"(it reads version {STATE_VERSION}); upgrade packshard"
            )
        fields: dict[str, Any] = {}
        for section, names in (
            ("dataset", ("fingerprint", "num_rows")),
            ("plan", ("seed", "shuffle", "epochs", "rows_per_step", "balance", "cost_model")),
            ("topology", ("dp_rank", "dp_size", "cp_rank", "cp_size", "cp_layout")),
            ("position", ("epoch", "offset", "step", "micro_step")),
        ):
            part = state.get(section)
            if not isinstance(part, dict):
                raise ValueError(
                    f"PackedShardStream state: section {section!r} is missing or not a dict"
                )
            missing = [n for n in names if n not in part]
            if missing:
                raise ValueError(f"PackedShardStream state: {section} lacks {missing}")
            fields.update({n: part[n] for n in names})
        for name in ("num_rows", "epoch", "offset", "step", "micro_step"):
            value = fields[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"PackedShardStream state: {name} must be an int >= 0, got {value!r}"
                )
        fields["cost_model"] = tuple(float(x) for x in fields["cost_model"])
        return cls(**fields)


def check_resume(saved: StreamState, current: StreamState) -> None:
    """Raise ValueError when `saved` cannot continue in a stream configured as `current`."""
    if saved.fingerprint != current.fingerprint or saved.num_rows != current.num_rows:
        raise ValueError(
            f"this state was saved on another dataset (fingerprint {saved.fingerprint}, {saved.num_rows} rows); "
            f"the stream reads fingerprint {current.fingerprint}, {current.num_rows} rows. "
            "Resume on the dataset the run started with, or start the stream fresh."
        )
    for name in ("seed", "shuffle") if saved.shuffle else ("shuffle",):  # no shuffle: no seed
        a, b = getattr(saved, name), getattr(current, name)
        if a != b:
            raise ValueError(
                f"state was saved with {name}={a!r} but the stream has {name}={b!r}; the row order would differ. "
                f"Construct the stream with {name}={a!r} to resume."
            )
    if saved.micro_step:
        for name in ("dp_size", "rows_per_step", "balance", "cost_model"):
            a, b = getattr(saved, name), getattr(current, name)
            if a != b:
                raise ValueError(
                    f"state was saved in the middle of step {saved.step} (after micro-step {saved.micro_step - 1}) "
                    f"with {name}={a!r}; resuming mid-step needs the same {name} (the stream has {b!r}). "
                    "Save checkpoints at step boundaries to change the topology or the step plan."
                )
