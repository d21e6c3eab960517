"""orch's elastic API for training code of your own (``entrypoint.script=train.py``); the built-in trainer is
built on it too.

    import orchestrator.elastic as elastic

    with elastic.init() as session:                       # config, process group, run dir
        model = session.wrap(build_model())               # parallelism.strategy: DDP, or FSDP2 per block
        optim = torch.optim.AdamW(model.parameters())     # over the wrapped module's parameters
        session.register(model=model, optim=optim)        # what checkpoints hold
        session.restore()                                 # newest valid checkpoint, if any
        sampler = session.global_batch_sampler(len(data), global_batch=24, micro_batch=4)
        batches = iter(DataLoader(data, batch_sampler=sampler))
        for step in session.steps():                      # step + 1 .. trainer.max_steps
            loss = train_step(model, optim, batches, sampler.accumulation_steps)
            session.step_done(loss=loss)                  # metrics, preemption, checkpoints

At every step boundary the session does what the built-in trainer does: rank 0 logs a ``metrics.jsonl``
record, all ranks agree on a preemption notice (then save an emergency checkpoint and leave with exit status
75, :class:`PreemptedExit`), periodic checkpoints are saved through orch's CheckpointManager; a restarted job
resumes at any world size with the same global batch and data order. Under a bare torchrun or a single
process (no ``ORCH_RUN_DIR``) nothing is written unless asked, and a lone process needs no process group.
The contract is in docs/user-scripts.md.
"""

from orchestrator.elastic.entry import init
from orchestrator.elastic.preemption import PreemptedExit
from orchestrator.elastic.session import Session
from orchestrator.preemption import PREEMPTED_EXIT_CODE
from orchestrator.runtime.sampler import GlobalBatchSampler
from orchestrator.runtime.state import Progress, Stateful

__all__ = ["init", "Session", "GlobalBatchSampler", "PreemptedExit", "PREEMPTED_EXIT_CODE", "Progress", "Stateful"]
