"""Hydra config groups shared by train_cls.py, train_det.py and train_seg.py.

Each task's primary config (``configs/{cls,det,seg}/config.yaml``) puts this package on Hydra's
search path (``pkg://cat.configs``) and starts from ``job.yaml``: the keys every cat job has, with the
same meaning everywhere. ``logger/`` is reached from every task the same way.
"""
