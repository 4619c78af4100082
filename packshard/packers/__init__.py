"""packshard's pure core: bin planning, padding and overlong rules, rank balancing, and the
shard format v1 (schema, writer, reader, manifest, index). Imports nothing of the other
packages; numpy, pyarrow and fsspec only."""

from packshard.packers.balance import (
    CostModel,
    imbalance,
    part_loads,
    partition_balanced,
    partition_round_robin,
)
from packshard.packers.bins import (
    ALGORITHMS,
    Algorithm,
    FlatPlan,
    lower_bound_rows,
    plan_bins,
    plan_rows,
)
from packshard.packers.format import (
    FORMAT_VERSION,
    INDEX_SCHEMA,
    SHARD_SCHEMA,
    DatasetNotFoundError,
    FormatError,
    StorageError,
)
from packshard.packers.overlong import (
    OVERLONG_POLICIES,
    OverlongPolicy,
    OverlongResult,
    apply_overlong,
    padded_length,
)
from packshard.packers.reader import ShardDataset, ShardEntry
from packshard.packers.rows import PackReport, build_rows, pack_table, row_index_stats
from packshard.packers.validate import row_problems
from packshard.packers.writer import (
    DatasetWriter,
    ShardRecord,
    finalize_dataset,
    rows_per_batch_for,
    url_to_fs,
    write_shard,
)

__all__ = [
    "ALGORITHMS",
    "FORMAT_VERSION",
    "INDEX_SCHEMA",
    "OVERLONG_POLICIES",
    "SHARD_SCHEMA",
    "Algorithm",
    "CostModel",
    "DatasetNotFoundError",
    "DatasetWriter",
    "FlatPlan",
    "FormatError",
    "OverlongPolicy",
    "OverlongResult",
    "PackReport",
    "ShardDataset",
    "ShardEntry",
    "ShardRecord",
    "StorageError",
    "apply_overlong",
    "build_rows",
    "finalize_dataset",
    "imbalance",
    "lower_bound_rows",
    "pack_table",
    "padded_length",
    "part_loads",
    "partition_balanced",
    "partition_round_robin",
    "plan_bins",
    "plan_rows",
    "row_index_stats",
    "row_problems",
    "rows_per_batch_for",
    "url_to_fs",
    "write_shard",
]
