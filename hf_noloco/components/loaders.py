"""Dataloaders over this replica's shard: every stage of a replica column gets the same batches.

The Trainer's own loader would shard by process; a pipeline shards by replica, so Accelerate's
``prepare_data_loader`` is called with the replica index and count. A streamed dataset
(:class:`~hf_noloco.data.streaming.TokenStream`) is read in the training process, whose position goes into
checkpoints, and only on the stages that use the batch's tensors.
"""

from __future__ import annotations

import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from hf_noloco.data.streaming import TokenStream
from hf_noloco.engine.mesh import PipelineMesh


class ReplicaLoaders:
    """Builds the training and evaluation loaders of this rank's replica, and keeps a training stream's
    position (:meth:`stream_state` / :meth:`load_stream_state`) for checkpoints.

    Args:
        mesh: the process mesh (its replica index and count shard the data).
        args: the :class:`~hf_noloco.NoLoCoConfig` (seeds and the Trainer's loader options).
        collate_fn: the batch collator.
    """

    def __init__(self, mesh: PipelineMesh, args, collate_fn):
        self.mesh, self.args, self.collate_fn = mesh, args, collate_fn
        self.train_stream: TokenStream | None = None  # this replica's shard of a streamed training set
        self._stream_position: dict | None = None  # read from a checkpoint before the shard exists

    def loader(self, dataset, batch_size: int, training: bool) -> DataLoader:
        if isinstance(dataset, TokenStream):
            return self._stream_loader(dataset, batch_size, training)
        args, workers = self.args, self.args.dataloader_num_workers
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=training,
            drop_last=training and args.dataloader_drop_last,
            collate_fn=self.collate_fn,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory and self.mesh.device.type == "cuda",
            # the Trainer's own loader options, which only apply with worker processes
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            multiprocessing_context=args.dataloader_multiprocessing_context if workers > 0 else None,
            in_order=args.dataloader_in_order,
        )
        return prepare_data_loader(
            loader,
            self.mesh.device,
            num_processes=self.mesh.num_replicas,
            process_index=self.mesh.replica,
            put_on_device=True,
            use_seedable_sampler=training,
            data_seed=args.data_seed or args.seed,
            even_batches=training,
            # from pinned memory, the copy to the GPU need not block the host (once a step)
            non_blocking=args.dataloader_pin_memory and self.mesh.device.type == "cuda",
        )

    def _stream_loader(self, stream: TokenStream, batch_size: int, training: bool) -> DataLoader:
        """Training reads the stream on the first and last stage, the only ones that use the batch's tensors;
        the stages between get rows of the same shape. Evaluation reads it on every stage (it is short and
        ends), starting over each time. Tensors stay on the CPU: the pipeline moves what it uses."""
        mesh = self.mesh
        if training:
            if self.train_stream is None:
                reads = mesh.is_first_stage or mesh.is_last_stage
                self.train_stream = stream.shard(mesh.replica, mesh.num_replicas, read=reads)
            if self._stream_position is not None:
                self.train_stream.load_state_dict(self._stream_position)
                self._stream_position = None
            shard = self.train_stream
        else:
            shard = stream.shard(mesh.replica, mesh.num_replicas)
        return DataLoader(shard, batch_size=batch_size, collate_fn=self.collate_fn, num_workers=0)

    def stream_state(self) -> dict | None:
        return self.train_stream.state_dict() if self.train_stream is not None else None

    def load_stream_state(self, state: dict | None) -> None:
        """A checkpoint's stream position, applied now or when the training shard is made."""
        if state is None:
            return
        if self.train_stream is not None:
            self.train_stream.load_state_dict(state)
        else:
            self._stream_position = state


def one_step(batches: list[dict]) -> dict:
    """An optimizer step's batches (``gradient_accumulation_steps`` of them) as one batch, rows in order: the
    pipeline runs them as one step, one schedule over all their microbatches."""
    return {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}
