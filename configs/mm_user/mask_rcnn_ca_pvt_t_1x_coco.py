# Mask R-CNN (FPN) with a CA-PVT-T backbone on COCO, 1x schedule, for mmdet's own tools:
#   python <mmdet>/.mim/tools/train.py configs/mm_user/mask_rcnn_ca_pvt_t_1x_coco.py
# (the README's "From mmdet / mmseg / timm" gives the commands). The same model and recipe as train_det.py's
# experiment=mask_rcnn_ca_pvt_t_1x (PVT's Mask R-CNN 1x: AdamW, lr 2e-4, weight decay 1e-4, 16 images a step).
_base_ = "mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py"

# The one line that brings cat in: registers TimmBackbone (and the rest of cat's components) with mmdet.
custom_imports = dict(imports=["cat.mm"], allow_failed_imports=False)
# Optional: checkpoints written as plain data, which a bare torch.load (weights_only) and any tool read.
custom_hooks = [dict(type="PortableCheckpointHook")]

model = dict(
    backbone=dict(
        _delete_=True,
        type="TimmBackbone",
        model_name="ca_pvt_tiny",
        out_indices=(0, 1, 2, 3),
        model_kwargs=dict(drop_path_rate=0.1),
        # An ImageNet checkpoint of train_cls.py or the release: pretrained='path/to/ca_pvt_tiny.pth'
        pretrained=None,
    ),
    neck=dict(in_channels=[64, 128, 320, 512]),
)

optim_wrapper = dict(
    _delete_=True,
    type="OptimWrapper",
    optimizer=dict(type="AdamW", lr=2e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={k: dict(decay_mult=0.0) for k in ("norm", "pos_embed", "cls_token")}),
)

# Where COCO is (train2017/, val2017/, annotations/instances_*.json); mmengine resolves the base's paths when it
# reads the base, so each dataloader and evaluator names the root again.
data_root = "data/coco/"
train_dataloader = dict(dataset=dict(data_root=data_root))
val_dataloader = dict(dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + "annotations/instances_val2017.json")
test_evaluator = val_evaluator
