"""`kvstore serve`'s flags for how GPU engines' blocks are copied (``CopySettings``)."""

from __future__ import annotations

import argparse

from kernels.block_copy import UNROLLS
from kvstore.cli.args import non_negative_int_arg, positive_int_arg, size_arg
from kvstore.engines.copy_settings import CopyMethod, CopySettings
from kvstore.sizes import format_bytes

_METHODS = [m.value for m in CopyMethod]


def _positive_size_arg(text: str) -> int:
    """argparse type: a SIZE larger than 0."""
    value = size_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be larger than 0, got {text!r}")
    return value


def _growth_arg(text: str) -> int:
    """argparse type: a load's chunk growth, a whole number >= 2."""
    value = positive_int_arg(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {text!r}")
    return value


def add_copy_flags(serve: argparse.ArgumentParser) -> None:
    defaults = CopySettings()
    group = serve.add_argument_group(
        "GPU copies", "how blocks move between registered GPU engines and the DRAM pool; the "
                      "defaults are the measured best, the others are there to compare")
    group.add_argument("--copy-small-runs", choices=_METHODS, default=defaults.small_runs.value,
                       help="method for batches of many small runs (vLLM's 32 KiB pieces): "
                            "staged (gathered on the GPU, a bus run per block), kernel (one "
                            "copy kernel over mapped pinned memory), batch (one "
                            "cuMemcpyBatchAsync), memcpy (a cudaMemcpyAsync per run) "
                            f"(default {defaults.small_runs})")
    group.add_argument("--copy-large-runs", choices=_METHODS, default=defaults.large_runs.value,
                       help="method for batches of large runs (kvengine's block-major blocks) "
                            f"(default {defaults.large_runs})")
    group.add_argument("--copy-packed-min-pieces", type=positive_int_arg, metavar="N",
                       default=defaults.packed_min_pieces,
                       help="whole blocks of a layout with at least N pieces per block are "
                            "packed on the GPU from their block ids; a larger N than any "
                            f"layout has turns packing off (default {defaults.packed_min_pieces})")
    group.add_argument("--copy-chunk-size", type=size_arg, metavar="SIZE",
                       default=defaults.chunk_bytes,
                       help="a save is submitted in chunks of at most SIZE, the next "
                            "prepared while one copies; 0: one submission per save "
                            f"(default {format_bytes(defaults.chunk_bytes)})")
    group.add_argument("--copy-load-chunk-size", type=size_arg, metavar="SIZE",
                       default=defaults.load_chunk_bytes,
                       help="a load is submitted in chunks of at most SIZE; 0: one submission "
                            f"per load (default {format_bytes(defaults.load_chunk_bytes)})")
    group.add_argument("--copy-load-growth", type=_growth_arg, metavar="N",
                       default=defaults.load_growth,
                       help="a load's chunks are N, N*N, ... blocks up to its chunk size (a "
                            "save's: 2, 4, 8, ...); 2 gives loads a save's ramp "
                            f"(default {defaults.load_growth})")
    group.add_argument("--copy-staging-slot-size", type=_positive_size_arg, metavar="SIZE",
                       default=defaults.staging_slot_bytes,
                       help="each of the GPU staging slots (4 per direction, on the engine's "
                            "device) a staged or packed batch goes through; larger batches go "
                            f"in parts (default {format_bytes(defaults.staging_slot_bytes)})")
    group.add_argument("--copy-save-kernels", action="store_true",
                       help="let saves pack, stage or copy with GPU kernels as loads do (faster "
                            "for many small pieces, but a kernel time-slices against the "
                            "engine's step); by default saves stay on the copy engines")
    group.add_argument("--copy-batch-keeps-gil", action="store_true",
                       help="the copy-engine batch call (cuMemcpyBatchAsync) holds the "
                            "interpreter's lock instead of releasing it (getting it back waits "
                            "behind the daemon's other threads; but a call that blocks stops "
                            "the whole daemon)")
    group.add_argument("--copy-wait-poll-us", type=non_negative_int_arg, metavar="US",
                       default=defaults.wait_poll_us,
                       help="wait for a batch's copies by asking its event every US "
                            "microseconds once its bytes could have crossed (blocking again "
                            "once it is well overdue); 0 blocks in cudaEventSynchronize "
                            f"(default {defaults.wait_poll_us})")
    group.add_argument("--copy-kernel-unroll", type=int, choices=UNROLLS, metavar="N",
                       default=defaults.kernel_unroll,
                       help="16-byte loads each thread of the copy kernels keeps in flight, one "
                            f"of {', '.join(map(str, UNROLLS))} (default {defaults.kernel_unroll})")


def copy_settings_from_args(args: argparse.Namespace) -> CopySettings:
    """The CopySettings of the flags above; ValueError if they make no sense."""
    return CopySettings(small_runs=args.copy_small_runs, large_runs=args.copy_large_runs,
                        packed_min_pieces=args.copy_packed_min_pieces,
                        chunk_bytes=args.copy_chunk_size,
                        load_growth=args.copy_load_growth,
                        load_chunk_bytes=args.copy_load_chunk_size,
                        staging_slot_bytes=args.copy_staging_slot_size,
                        kernel_unroll=args.copy_kernel_unroll,
                        save_kernels=args.copy_save_kernels,
                        batch_keeps_gil=args.copy_batch_keeps_gil,
                        wait_poll_us=args.copy_wait_poll_us)
