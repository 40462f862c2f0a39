"""Training-process telemetry: step, collective, data-loading and checkpoint spans; progress heartbeats, stacks,
exceptions and process exits (log records with an event name)."""
from __future__ import annotations

import enum

from otel_gpu.schema._model import MetricType, attr, enumeration, event, metric, span
from otel_gpu.schema.identity import HOST_NAME, JOB_ID, RANK

_G = "Training"


@enumeration
class ExceptionHint(str, enum.Enum):
    """Classification of an exception that ended a rank, from its type and message."""

    CUDA_OOM = "cuda_oom"
    NCCL_ERROR = "nccl_error"
    GLOO_ERROR = "gloo_error"
    DIST_TIMEOUT = "dist_timeout"
    PEER_FAILURE = "peer_failure"  # a collective failed because a peer went away: a consequence
    CUDA_ERROR = "cuda_error"
    KEYBOARD_INTERRUPT = "keyboard_interrupt"
    USER_CODE = "user_code"


STEP = attr("training.step", "int", "Optimizer step number (the step span's or the latest completed).", group=_G)
COLL_OP = attr("collective.op", "string", "Operation: all_reduce, all_gather_into_tensor, broadcast, send, recv, "
               "barrier, ...", group=_G)
COLL_PG = attr("collective.pg.name", "string", "Process group name (torch's pg name, '0' for the default group).",
               group=_G)
COLL_PG_SIZE = attr("collective.pg.size", "int", "Ranks in the process group.", group=_G)
COLL_SEQ = attr("collective.seq", "int", "Per-process-group sequence number of the operation (1-based).", group=_G)
COLL_BYTES = attr("collective.bytes", "int", "Payload bytes of this rank's input.", group=_G)
COLL_DTYPE = attr("collective.dtype", "string", "Tensor dtype, e.g. float32.", group=_G)
COLL_ASYNC = attr("collective.async", "bool", "Issued with async_op=True (completion awaited by Work.wait).",
                  group=_G)
COLL_PEER = attr("collective.peer", "int", "Peer rank of a point-to-point op (send/recv), or src/dst root.",
                 group=_G)
COLL_SOURCE = attr("collective.source", "string", "How it was seen: python (wrapped API) or flight_recorder "
                   "(issued in C++, e.g. DDP's reducer or FSDP).", group=_G, values=("python", "flight_recorder"))
COLL_P2P = attr("collective.p2p", "bool", "Point-to-point op (send/recv/isend/irecv); collective.seq then counts this "
                "group's point-to-point ops issued from Python, not torch's collective sequence.", group=_G)
COLL_DURATION_KNOWN = attr("collective.duration_known", "bool", "False on flight-recorder spans whose completion "
                           "time torch did not record (gloo): the span then has zero length.", group=_G)
PROCESS_ROLE = attr("otel_gpu.process.role", "string", "Resource attribute of the `otel-gpu run` launcher's own "
                    "records.", group=_G, values=("launcher",))
STATE = attr("training.state", "string", "What the rank is doing: step, collective, data, checkpoint, idle.",
             group=_G, values=("step", "collective", "data", "checkpoint", "idle"))
INFLIGHT_SINCE = attr("training.inflight.since", "double", "When the in-flight operation started (unix s).", group=_G)
INFLIGHT_FOR = attr("training.inflight.duration", "double", "Seconds the in-flight operation has been running.",
                    group=_G)
EXC_TYPE = attr("exception.type", "string", "Exception class, qualified.", group=_G, semconv=True)
EXC_MESSAGE = attr("exception.message", "string", "Exception message.", group=_G, semconv=True)
EXC_STACK = attr("exception.stacktrace", "string", "Formatted traceback.", group=_G, semconv=True)
EXC_HINT = attr("exception.hint", "string", "Classification of the exception.", group=_G, values=ExceptionHint)
THREAD_NAME = attr("thread.name", "string", "Thread the exception was raised in.", group=_G, semconv=True)
EXIT_CODE = attr("process.exit.code", "int", "Exit status of a launched process (negative: killed by signal).",
                 group=_G)
EXIT_SIGNAL = attr("process.exit.signal", "string", "Signal that ended the process, e.g. SIGKILL.", group=_G)
EXIT_HOW = attr("process.exit.how", "string", "How a launched process ended: exited, exception, killed, or vanished "
                "(gone with no status anyone could read: SIGKILL or os._exit; never a clean exit).", group=_G)
PROCESS_STATE = attr("process.state", "string", "Kernel state of a live rank's main thread (/proc/PID/stat): R, S, "
                     "D (uninterruptible), T (stopped), t (traced).", group=_G)
PROCESS_WCHAN = attr("process.wchan", "string", "Kernel function a frozen rank waits in (/proc/PID/wchan).",
                     group=_G)
PROCESS_FROZEN = attr("process.frozen", "string", "How a rank is frozen: stopped (state T), gpu_driver (state D in "
                      "the NVIDIA driver), uninterruptible (state D elsewhere); absent when it runs again.", group=_G)
CHECKPOINT_BYTES = attr("checkpoint.bytes", "int", "Bytes written or read, when known.", group=_G)
CHECKPOINT_PATH = attr("checkpoint.path", "string", "Checkpoint path, when known.", group=_G)

STEP_SPAN = span("otel_gpu.step", "One training step (optimizer step hook or otel_gpu.step()).", group=_G,
                 attributes=(STEP,))
COLLECTIVE_SPAN = span("otel_gpu.collective", "One collective or point-to-point operation, issue to completion.",
                       group=_G, attributes=(COLL_OP, COLL_PG, COLL_PG_SIZE, COLL_SEQ, COLL_BYTES, COLL_DTYPE,
                                             COLL_ASYNC, COLL_PEER, COLL_SOURCE, COLL_P2P, COLL_DURATION_KNOWN,
                                             STEP))
WAIT_SPAN = span("otel_gpu.work.wait", "Waiting on an async collective's Work.wait().", group=_G,
                 attributes=(COLL_OP, COLL_PG, COLL_SEQ))
DATA_SPAN = span("otel_gpu.data.wait", "Time the training loop waited for the next batch from a DataLoader.",
                 group=_G, attributes=(STEP,))
CKPT_SAVE_SPAN = span("otel_gpu.checkpoint.save", "Blocking part of a checkpoint save (torch.save, DCP save, "
                      "otel_gpu.checkpoint()).", group=_G, attributes=(STEP, CHECKPOINT_BYTES, CHECKPOINT_PATH))
CKPT_LOAD_SPAN = span("otel_gpu.checkpoint.load", "Checkpoint restore (torch.load, DCP load).", group=_G,
                      attributes=(STEP, CHECKPOINT_BYTES, CHECKPOINT_PATH))

PROGRESS_EVENT = event("otel_gpu.progress", "Heartbeat from a rank's watchdog thread, sent every few seconds even "
                       "while the main thread is blocked.", group=_G,
                       attributes=(STEP, STATE, COLL_OP, COLL_PG, COLL_SEQ, INFLIGHT_SINCE, INFLIGHT_FOR),
                       body="{step, state, inflight: {kind, op, pg, seq, since} | null, last_seq: {pg: seq}, "
                            "last_started_seq: {pg: seq}, counters: {steps, collectives, dropped}}")
STACKS_EVENT = event("otel_gpu.stacks", "Python stacks of all threads, captured when an operation is stuck past "
                     "the threshold.", group=_G, attributes=(STEP, COLL_OP, COLL_SEQ, INFLIGHT_FOR),
                     body="{threads: [{name, id, main, frames: [{file, line, function}]}], top: 'file:line func'}")
NODE_DIGEST_EVENT = event("otel_gpu.node.digest", "A node sidecar's summary of its ranks of one job, one per node per "
                          "interval (compact processor, digests on): what the aggregator needs instead of every "
                          "rank's heartbeats and step spans.", group=_G, attributes=(JOB_ID, HOST_NAME),
                          body="{v, host, time, interval_s, ranks: [rank], who: {rank: {local_rank, pid, gpu, "
                               "gpu_uuid, world_size, restart_count, net_ifaces, started}}, groups: [{ranks, fresh, "
                               "step, state, inflight, last_seq, last_started_seq, stack_top, stalled_s, "
                               "steps_done}], pg: {pg: {completed: [min, max], started: [min, max], inflight: [min, "
                               "max] | null, behind: [rank]}}, step_rows: [[step, ranks, start, end, duration, data_s, "
                               "checkpoint_s, data_growth_min, collective_floor_min, [[rank, compute_growth, "
                               "data_growth]]]], step_s: [min, median, max] | null, stalled: {rank, s} | null, "
                               "changed: [rank], gone: [rank]} (v 2; step_rows: processors/compact/_digest.py)")
EXCEPTION_EVENT = event("otel_gpu.exception", "An uncaught exception in a training process (main or other thread).",
                        group=_G, attributes=(EXC_TYPE, EXC_MESSAGE, EXC_STACK, EXC_HINT, THREAD_NAME, STEP))
SIGNAL_EVENT = event("otel_gpu.signal", "A training process received SIGTERM/SIGINT (and was flushed).", group=_G,
                     attributes=(EXIT_SIGNAL, STEP))
EXIT_EVENT = event("otel_gpu.process.exit", "A process launched by `otel-gpu run` (or a rank, atexit) ended.",
                   group=_G, attributes=(JOB_ID, RANK, EXIT_CODE, EXIT_SIGNAL, EXIT_HOW))
STATE_EVENT = event("otel_gpu.process.state", "`otel-gpu run` saw a live rank frozen (state T or D for 2 s: it "
                    "exists but does not run), or running again.", group=_G,
                    attributes=(JOB_ID, RANK, PROCESS_STATE, PROCESS_WCHAN, PROCESS_FROZEN),
                    body="{pid, rank, state, how, wchan, stack (kernel stack, root only), since, resumed}")

RESTART_EVENT = event("otel_gpu.restart.decision", "What `otel-gpu run --restart` decided after a failure of the job "
                      "(restart, exclude and restart, stop with the diagnosis, give up: budget spent) and why.",
                      group=_G, attributes=(JOB_ID,),
                      body="{job_id, incarnation, restart_count, time, trigger, exit_status, failure_id, root_cause, "
                           "action, decision, reason, backoff_s, restarts_in_window, excluded, time_saved_s, "
                           "incarnation_start, incarnation_end}")

STEP_DURATION = metric("otel_gpu.step.duration", MetricType.GAUGE, "s", "Duration of the latest step, per rank.",
                       group=_G)
COLLECTIVE_DURATION = metric("otel_gpu.collective.duration", MetricType.HISTOGRAM, "s",
                             "Collective durations, by op.", group=_G, attributes=(COLL_OP,))
INSTR_DROPPED = metric("otel_gpu.instrumentation.dropped", MetricType.COUNTER, "{record}",
                       "Records the in-process ring buffer dropped because export could not keep up.", group=_G)

# Per-step breakdown, computed in the training process and set on the step span: what separates a straggler's
# compute from its peers' waiting in the collectives (DDP ranks all take the same step time).
STEP_COLLECTIVE_S = attr("training.step.collective_time", "double", "Seconds of the step during which at least one "
                         "collective of this rank was in flight (union of intervals).", group=_G)
STEP_DATA_S = attr("training.step.data_time", "double", "Seconds of the step spent waiting for data.", group=_G)
STEP_CHECKPOINT_S = attr("training.step.checkpoint_time", "double", "Seconds of the step spent in blocking "
                         "checkpoint saves.", group=_G)
