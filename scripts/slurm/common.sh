# Shared by the sbatch templates: run from the checkout with its .venv, forward preemption.
# Submit from the repository root (sbatch copies the script, so its own path is not the checkout).
cd "${SLURM_SUBMIT_DIR:-.}"
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# On USR1 (time limit near, --signal=B:USR1@300) or TERM (preemption), pass SIGTERM to the
# trainers, which save a mid-epoch checkpoint and exit; then put the job back in the queue.
launch() {
    "$@" &
    local child=$!
    requeue() {
        echo "cat: signal received, checkpointing and requeueing job $SLURM_JOB_ID"
        kill -TERM "$child" 2>/dev/null || true
        wait "$child" || true
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    }
    trap requeue USR1 TERM
    wait "$child"
}
