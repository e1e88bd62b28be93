# UperNet with a CA-Swin-T backbone on ADE20K, 160k iterations at 512x512, for mmseg's own tools:
#   python <mmseg>/.mim/tools/train.py configs/mm_user/upernet_ca_swin_t_160k_ade20k.py
# (the README's "From mmdet / mmseg / timm" gives the commands). The same model and recipe as train_seg.py's
# experiment=upernet_ca_swin_t_160k (Swin's UperNet: AdamW, lr 6e-5, weight decay 0.01, 16 images a step).
_base_ = "mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py"

# The one line that brings cat in: registers TimmBackbone (and the rest of cat's components) with mmseg.
custom_imports = dict(imports=["cat.mm"], allow_failed_imports=False)
# Optional: checkpoints written as plain data, which a bare torch.load (weights_only) and any tool read.
custom_hooks = [dict(type="PortableCheckpointHook")]

model = dict(
    backbone=dict(
        _delete_=True,
        type="TimmBackbone",
        model_name="ca_swin_tiny",
        out_indices=(0, 1, 2, 3),
        model_kwargs=dict(drop_path_rate=0.3),
        # An ImageNet checkpoint of train_cls.py or the release: pretrained='path/to/ca_swin_tiny.pth'
        pretrained=None,
    ),
)

# Where ADE20K is (images/training, annotations/training, images/validation, ...); mmengine resolves the base's
# paths when it reads the base, so each dataloader names the root again.
data_root = "data/ade/ADEChallengeData2016"
train_dataloader = dict(dataset=dict(data_root=data_root))
val_dataloader = dict(dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
