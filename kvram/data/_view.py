"""`read="view"` batches: TensorFlow slices each batch from tensors over the
memory-mapped shards (DLPack, no copy), with no Python per batch once every
shard is checked (`ShardedDataset.to_tf_dataset`)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def epoch_seeds(seed, repeat: bool):
    """A dataset of one random seed per epoch (one epoch unless `repeat`): a new
    draw every iteration over it, the same sequence for the same `seed`."""
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
    return seeds if repeat else seeds.take(1)


# -- read="view": batches assembled by TensorFlow from tensors over the mapped shards
def shard_tensor_lists(dataset, names) -> dict | None:
    """{field: a TensorList of every shard's tensor over its mapped file}, or
    None when a payload is not 64-byte aligned (TF would copy it)."""
    lists = {}
    for name in names:
        dtype, shape = tf.as_dtype(dataset.fields[name][0]), dataset.fields[name][1]
        handle = tf.raw_ops.EmptyTensorList(
            element_shape=tf.constant((-1,) + shape, tf.int32), max_num_elements=-1,
            element_dtype=dtype,
        )
        for shard in dataset._shards:
            tensor = shard.tensor(name)
            if tensor is None:
                return None
            handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=tensor)
        lists[name] = handle
    return lists


def plan_pieces(starts_of_shards, blocks, batch_size: int, batches: int, least_slots: int = 1):
    """The reading plan of an epoch whose rows come in `blocks` ([start, stop)
    rows, in reading order), cut into batches: (pieces [batches, most, 3] as
    (shard, first row in the shard, rows), pieces per batch [batches])."""
    starts, stops = blocks[:, 0], blocks[:, 1]
    lengths = stops - starts
    offsets = np.cumsum(lengths) - lengths  # of each block in the epoch's stream
    first = offsets // batch_size
    last = (offsets + lengths - 1) // batch_size
    repeats = last - first + 1
    block = np.repeat(np.arange(len(blocks)), repeats)
    batch = first[block] + np.arange(len(block)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    low = np.maximum(offsets[block], batch * batch_size) - offsets[block]
    high = np.minimum(offsets[block] + lengths[block], (batch + 1) * batch_size) - offsets[block]
    keep = batch < batches  # drop_remainder: the short last batch's pieces
    block, batch, low, high = block[keep], batch[keep], low[keep], high[keep]
    begin = starts[block] + low
    shard = np.searchsorted(starts_of_shards, begin, side="right") - 1
    counts = np.bincount(batch, minlength=batches)
    slot = np.arange(len(batch)) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.zeros((batches, max(least_slots, int(counts.max())), 3), np.int64)
    table[batch, slot] = np.stack([shard, begin - starts_of_shards[shard], high - low], axis=1)
    return table, counts.astype(np.int64)


def view_batches(sharded, names, lists, batch_size, batches, block, shuffle, seed, repeat,
                 drop_remainder, num_parallel_reads):
    shard_blocks = np.stack([sharded._starts[:-1], sharded._starts[1:]], axis=1)
    # Pieces unrolled in the graph: in order, as many as a batch has at most
    # (the plan, computed once, is every epoch's); shuffled, those of a batch
    # of whole blocks, plus one, at most 32 (a loop reads a batch of more).
    if shuffle:
        slots = min(-(-batch_size // block) + 1, 32)
    else:
        in_order = plan_pieces(sharded._starts, shard_blocks, batch_size, batches)
        slots = in_order[0].shape[1]
    verify = sharded._verifier is not None and not all(sharded._verifier._done)

    def plan(epoch_seed):
        # Python once an epoch: the order of the blocks and where each batch's rows lie.
        blocks = sharded._epoch_plan(block, int(epoch_seed))[0] if shuffle else shard_blocks
        checked = sharded._verifier is None or all(sharded._verifier._done)
        if not checked:
            sharded._start_verification(blocks[:, 0])
        table, counts = plan_pieces(sharded._starts, blocks, batch_size, batches, slots) if shuffle else in_order
        return table, counts, np.full(batches, checked)

    def ensure(shards):
        for number in np.unique(shards):
            sharded._verifier.ensure(int(number))
        return np.bool_(True)

    def epoch(epoch_seed):
        table, counts, checked = tf.numpy_function(
            plan, [epoch_seed], (tf.int64, tf.int64, tf.bool), stateful=False
        )
        table.set_shape((batches, None, 3))
        counts.set_shape((batches,))
        checked.set_shape((batches,))
        return tf.data.Dataset.from_tensor_slices((table, counts, checked))

    def assemble(pieces, count, checked):
        ready = []
        if verify:
            # Until every shard is checked (the first epoch), a batch waits for its shards.
            ready = [tf.cond(
                checked,
                lambda: tf.constant(True),
                lambda: tf.numpy_function(ensure, [pieces[:count, 0]], tf.bool, stateful=True),
            )]
        out = []
        with tf.control_dependencies(ready):
            for name in names:
                dtype, shape = tf.as_dtype(sharded.fields[name][0]), sharded.fields[name][1]

                def piece(j, name=name, dtype=dtype, shape=shape):
                    tensor = tf.raw_ops.TensorListGetItem(
                        input_handle=lists[name], index=tf.cast(pieces[j, 0], tf.int32),
                        element_shape=tf.constant((-1,) + shape, tf.int32), element_dtype=dtype,
                    )
                    return tensor[pieces[j, 1]:pieces[j, 1] + pieces[j, 2]]

                def gathered(piece=piece, dtype=dtype, shape=shape):
                    size = tf.cast(count, tf.int32)
                    parts = tf.TensorArray(dtype, size=size, infer_shape=False, element_shape=(None,) + shape)
                    parts = tf.while_loop(
                        lambda j, parts: j < size,
                        lambda j, parts: (j + 1, parts.write(j, piece(j))),
                        (tf.constant(0), parts),
                    )[1]
                    return parts.concat()

                def unrolled(piece=piece):
                    # Slots past `count` are empty slices (0 rows), which concat skips.
                    return tf.concat([piece(j) for j in range(slots)], axis=0)

                # One piece: a slice of the mapped shard, no copy; several: one copy
                # (a loop only for batches of more pieces than a shuffled batch's
                # usual most: short blocks at the ends of shards).
                if slots == 1:  # every batch lies in one shard
                    tensor = piece(0)
                elif not shuffle:  # no batch has more than `slots` pieces
                    tensor = tf.cond(tf.equal(count, 1), lambda piece=piece: piece(0), unrolled)
                else:
                    tensor = tf.case(
                        [(tf.equal(count, 1), lambda piece=piece: piece(0)),
                         (count <= slots, unrolled)],
                        default=gathered,
                    )
                tensor.set_shape((batch_size if drop_remainder else None,) + shape)
                out.append(tensor)
        return out[0] if len(out) == 1 else tuple(out)

    if shuffle:
        seeds = epoch_seeds(seed, repeat)
    else:
        seeds = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
        if repeat:
            seeds = seeds.repeat()
    dataset = seeds.flat_map(epoch)
    return dataset.map(assemble, num_parallel_calls=num_parallel_reads, deterministic=True)
