"""Image classification on :mod:`cat.runtime`: the config schema (``schema``), what a run is built
from (``builders``, ``state``), the step and epoch loops (``loops``), the trainer that resumes,
checkpoints and logs (``trainer``, ``checkpoints``) and the job with its three modes (``job``)."""
