"""Image classification on :mod:`cat.runtime`: the config schema (``schema``), what a run is built
from (``model_building``, ``data_loading``, ``optimization``, ``meters``, ``state``), the step and epoch loops
(``loops``), its metrics declared once (``metrics``), the trainer that resumes, checkpoints and logs (``trainer``,
``checkpoints``) and the job with its three modes (``job``)."""
