"""Datasets larger than RAM: `.npy` shards on disk, written atomically and read
into `tf.data` at the speed of the disk, every byte checked against its
checksum before it is trained on. The format: `kvram/data/_format.py`."""

from kvram.data._dataset import ShardedDataset
from kvram.data._format import FORMAT, VERSION, ShardError, raise_shard_errors
from kvram.data._images import decode_jpeg, write_image_shards
from kvram.data._writer import write_shards

__all__ = [
    "write_shards",
    "write_image_shards",
    "decode_jpeg",
    "ShardedDataset",
    "ShardError",
    "raise_shard_errors",
    "FORMAT",
    "VERSION",
]
