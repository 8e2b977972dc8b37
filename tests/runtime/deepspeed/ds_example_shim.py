"""Test-only CPU shim for DeepSpeedExamples' training/pipeline_parallelism/train.py, applied in-process.

    RANK=.. WORLD_SIZE=2 ... python ds_example_shim.py --kareus-plan P [--kareus-*] -- train.py ARGS

Then it runs ``kareus_megatron.deepspeed.main`` (the documented ``-m kareus_megatron.deepspeed`` launcher)
on the UNMODIFIED script. What the shim changes, none of it in the example's files:

- ``torchvision`` is a stand-in in ``sys.modules`` (PyPI's torchvision does not import beside this CPU
  torch): ``transforms`` (Compose, Resize, CenterCrop, ToTensor, Normalize: unused), ``datasets.CIFAR10``
  (synthetic 3x32x32 images and labels, no download), ``models.AlexNet`` (torchvision's layer layout
  ``features`` / ``avgpool`` / ``classifier``, a few channels wide so a 32-micro-batch step takes
  milliseconds on a CPU) and ``models.vgg19`` (imported, not used);
- DeepSpeed's JIT builds are skipped: its shm comm op (``build_shm_op``, ~55 s) and FusedAdam, which
  ds_config's ``"Adam"`` selects (~60 s): torch's Adam/AdamW stands in (``deepspeed.ops.adam.FusedAdam``);
- ``torch.cuda.set_device`` is a no-op (train.py calls it after ``init_distributed``);
- after the script: barrier and ``destroy_process_group`` (gloo; see docs/guides/deepspeed.md),
  then the process ends with the launcher's exit status.
"""

from __future__ import annotations

import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", ".."))  # tests/: _dist

IMAGE = 32  # side of the synthetic images (px)
SAMPLES = 256


def _fake_torchvision() -> None:
    import torch
    from torch import nn

    class _Ignored:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __call__(self, x: object) -> object:
            return x

    class CIFAR10(torch.utils.data.Dataset):
        def __init__(self, root: str, train: bool = True, download: bool = False, transform: object = None):
            g = torch.Generator().manual_seed(7)
            self.x = torch.randn(SAMPLES, 3, IMAGE, IMAGE, generator=g)
            self.y = torch.randint(0, 10, (SAMPLES,), generator=g)

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.x[i], self.y[i]

    class AlexNet(nn.Module):
        def __init__(self, num_classes: int = 1000) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 8, kernel_size=5, stride=2, padding=2),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(8, 16, kernel_size=3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(16, 16, kernel_size=3, padding=1),
                nn.ReLU(),
                nn.Conv2d(16, 16, kernel_size=3, padding=1),
                nn.ReLU(),
                nn.Conv2d(16, 16, kernel_size=3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
            self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
            self.classifier = nn.Sequential(
                nn.Dropout(),
                nn.Linear(16 * 2 * 2, 32),
                nn.ReLU(),
                nn.Dropout(),
                nn.Linear(32, 32),
                nn.ReLU(),
                nn.Linear(32, num_classes),
            )

    def vgg19(*args: object, **kwargs: object) -> nn.Module:
        raise NotImplementedError("the torchvision stand-in has AlexNet only")

    tv = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    for name in ("Compose", "Resize", "CenterCrop", "ToTensor", "Normalize"):
        setattr(transforms, name, type(name, (_Ignored,), {}))
    datasets = types.ModuleType("torchvision.datasets")
    datasets.CIFAR10 = CIFAR10  # type: ignore[attr-defined]
    models = types.ModuleType("torchvision.models")
    models.AlexNet, models.vgg19 = AlexNet, vgg19  # type: ignore[attr-defined]
    tv.transforms, tv.datasets, tv.models = transforms, datasets, models  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "torchvision": tv,
            "torchvision.transforms": transforms,
            "torchvision.datasets": datasets,
            "torchvision.models": models,
        }
    )


def main() -> None:
    import torch

    torch.set_num_threads(1)
    _fake_torchvision()
    torch.cuda.set_device = lambda device: None  # CPU: train.py's set_device(local_rank)
    import deepspeed

    sys.stderr.write(f"ds-shim: deepspeed {deepspeed.__version__}\n")  # which release ran (the tests check it)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the ~55 s JIT build
    import deepspeed.ops.adam as ds_adam

    def fused_adam(params: object, adam_w_mode: bool = True, **kwargs: object) -> torch.optim.Optimizer:
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **kwargs)  # type: ignore[arg-type]

    ds_adam.FusedAdam = fused_adam  # ds_config's "Adam": torch's, not the ~60 s JIT build of fused_adam
    import kareus_megatron.deepspeed as kareus

    code = kareus.main(sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    import _dist

    _dist.exit_process(code)  # a gloo worker may still hold DeepSpeed's loss broadcast (see there)


if __name__ == "__main__":
    main()
