"""Training under torchrun (docs/distributed.md), the machine's side of a stage: the process group, the model wrapped
for it (DDP, or FSDP2 with --fsdp), each process's part of a global batch (and --grad-accum's micro-batches), and when
gradients are reduced. A plain `python` run is rank 0 of 1 and skips all of it: distribute gives back the model
itself, parts the whole batch. Every rank builds the same global batches from the same seed and takes its part.
"""
import os
import sys
import time

import torch


def setup_distributed():
    """-> (rank, world size); joins the process group (nccl on GPUs, gloo on CPU) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        per_node, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.cuda.device_count()
        if per_node > gpus:  # NCCL cannot share one GPU between two processes of a group: plumbing.die's one line
            # (plumbing imports this module, not the other way round): rank 0 says it, another rank only if it did not
            if not is_main():
                time.sleep(10)
            print(f"error: torchrun started {per_node} processes on this machine but it has {gpus} GPU(s): one process "
                  f"per GPU (--nproc-per-node {gpus}), or CUDA_VISIBLE_DEVICES= to run {per_node} processes on the CPU",
                  file=sys.stderr)
            sys.exit(2)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # then pick_device's "cuda" is this GPU
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), world


def is_main():
    """Rank 0 (or alone) writes artifacts, metrics and the progress bar."""
    return int(os.environ.get("RANK", 0)) == 0


def finish_distributed():
    if torch.distributed.is_initialized():  # all ranks together: gloo aborts if one leaves mid-write
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def distribute(model, world, fsdp):
    """The module to train: the model alone; DDP (a copy per process); or with --fsdp FSDP2 (each
    decoder layer, then the root, sharded across processes, in place)."""
    if world == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
            fully_shard(layer)
        # the root resharded after every forward too: left whole after a no_grad forward, it missed updates
        return fully_shard(model, reshard_after_forward=True)
    device = next(model.parameters()).device
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])


def full_state(model, fsdp):
    """--fsdp: the whole state dict gathered for rank 0 (every rank calls this); else None."""
    if not (fsdp and torch.distributed.is_initialized()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    own = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}  # a tied weight once
    return {k: v for k, v in state.items() if k in own}


def parts(idx, n_loss, model, args):
    """torchrun's bookkeeping of one optimizer step, behind one call: the micro-batches of batch `idx` (trajectory
    indices) that this process computes -> yields (ids, share), the stage then runs forward, loss and
    (loss * share).backward() on each; alone without --grad-accum (00 has neither): one, (idx, 1.0). n_loss[j] is what
    trajectory j adds to the count the step's loss averages over (its reply tokens in 01/05, its step weights in 03,
    its trained tokens in 00).
    Each part's loss is a mean over its own count, so with share = world * its count / the batch's count,
    sum(share * part loss), averaged over the processes by DDP, is the single-process loss of the whole
    batch. Every process knows idx (the same seed), so the batch's count needs no communication.
    Gradients are reduced across processes in the last part's backward only."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    n = min(getattr(args, "grad_accum", 1), -(-len(idx) // world))  # no more than the largest rank's trajectories
    # This rank's part, then --grad-accum's n micro-batches of it (n on every rank), each (indices, weight): one left
    # empty re-reads a trajectory with weight 0 (DDP needs every rank in every step).
    mine, keep = (idx[rank::world], 1.0) if idx[rank::world] else (idx[:1], 0.0)
    groups = [(mine[i::n], 1.0) if mine[i::n] else (mine[:1], 0.0) for i in range(n)]
    total = sum(n_loss[j] for j in idx)
    for i, (ids, w) in enumerate(groups):
        grad_sync(model, world, getattr(args, "fsdp", False), on=i == len(groups) - 1)
        yield ids, keep * w * world * sum(n_loss[j] for j in ids) / max(total, 1e-8)


def average_info(infos):
    """[(info, share, tokens)] of the step's micro-batches (parts) -> (their info dicts averaged with the shares over
    the global batch: the single-process numbers, the tokens this process read)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    numbers = sum(torch.tensor(list(info.values()), dtype=torch.float64) * share / world for info, share, _ in infos)
    if world > 1:  # nccl reduces GPU tensors (setup_distributed), gloo CPU ones
        numbers = numbers.to("cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(numbers)
    return dict(zip(infos[0][0], numbers.tolist())), sum(tokens for *_, tokens in infos)


def unsharded(p):
    """--fsdp: the whole tensor of a sharded parameter (every rank calls this); else p itself."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def grad_sync(model, world, fsdp, on):
    """Reduce gradients across processes in this backward (the last micro-batch) or not."""
    if world > 1 and fsdp:
        model.set_requires_gradient_sync(on)
    elif world > 1:
        model.require_backward_grad_sync = on
