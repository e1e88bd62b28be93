# Shared by the sbatch templates; sourced from the checkout they were submitted from.
# sbatch runs a copy of the batch script from slurmd's spool folder, so the templates find this file
# (and the checkout) through $CAT_ROOT, default $SLURM_SUBMIT_DIR: submit from the repository root.
CAT_ROOT=${CAT_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$CAT_ROOT"
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}
# How long torchrun lets its trainers finish their step and save after a stop before it kills them: its
# default, 30 s, can be shorter than a large checkpoint's write to a shared filesystem. Within the 300 s
# that --signal=B:USR1@300 leaves before the time limit.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}

# Processes per node: the GPUs Slurm gave this job, else those the node shows, else one (CPU).
gpus_per_node() {
    if [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "$SLURM_GPUS_ON_NODE" -gt 0 ] 2>/dev/null; then
        echo "$SLURM_GPUS_ON_NODE"
    elif command -v nvidia-smi >/dev/null 2>&1 && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [ "$n" -gt 0 ]; then
        echo "$n"
    else
        echo 1
    fi
}

# The job's own rendezvous port, 20000-31999 (a requeued job keeps its id, so its port): two jobs that share
# a node never bind the same one, and no outgoing connection holds it (Linux gives those from 32768 up).
# cat's submitit path derives it the same way (cat/runtime/dist.py).
rendezvous_port() {
    echo $((20000 + SLURM_JOB_ID % 12000))
}

# Run the training step ("$@", an srun command) and handle preemption. On USR1 (time limit near,
# --signal=B:USR1@300; or `scancel --signal=USR1 --batch JOB`) or TERM, send SIGTERM to the step's
# tasks (not to srun, which would cancel the step and kill them), so every trainer finishes its
# step, saves a checkpoint and exits; then requeue the job, which resumes from output_dir.
launch() {
    "$@" &
    local step=$!
    preempt() {
        echo "cat: signal received; asking the trainers to checkpoint (job $SLURM_JOB_ID)"
        scancel --signal=TERM "$SLURM_JOB_ID"
        wait "$step" || true
        echo "cat: trainers stopped; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    }
    trap preempt USR1 TERM
    wait "$step"
}
