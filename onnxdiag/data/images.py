"""Image folders → arrays in the model's layout (Pillow).

A folder with class sub-folders is labelled: the sorted sub-folder names are the
classes 0..K-1 (an empty sub-folder still takes its index, so labels stay aligned
with the model's classes).  A flat folder is unlabelled.

A folder holding exactly the two sub-folders ``images/`` and ``masks/`` is a
segmentation folder (docs/METHODS.md §A4): every image ``images/NAME.ext`` has the mask
``masks/NAME.png`` (same file stem, any image suffix), a single-channel image of the
same size whose pixel values are class indices (Pillow modes L, P — the palette index,
not its colour — I;16 or I), 255 marking ignored pixels.  The masks become the label
maps (n, H, W), resized (nearest neighbour) and cropped exactly like their images, so
they stay aligned with the model input.  Preprocessing, in order:
convert to grayscale/RGB (from the model's channel count), resize the shorter side
to ``size``, centre-crop to ``crop``, ``pixel * scale``, ``(x - mean) / std`` per
channel, transpose to the layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError

__all__ = ["IMAGE_SUFFIXES", "ImageOptions", "list_images", "load_images", "resolve_options"]

IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)


@dataclass(frozen=True)
class ImageOptions:
    """How images become an input tensor.

    Attributes:
        size: resize so the shorter side is ``size`` pixels (bilinear); None: no
            resize, unless ``crop`` is set and the image is not already that size:
            then the smallest resize that covers the crop **(our default)**.
        crop: centre crop ``(height, width)`` or one int for a square; None: the
            model's fixed H×W when it has one, else no crop.
        scale: pixels (0..255) are multiplied by this first.
        mean, std: per-channel normalisation after scaling (None: 0 and 1).
        layout: "NCHW", "NHWC" or "auto" (from the input's shape: the axis of size 1 or 3).
        channels: 1 (grayscale) or 3 (RGB); None: from the input's shape.
    """

    size: int | None = None
    crop: int | tuple[int, int] | None = None
    scale: float = 1 / 255
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    layout: str = "auto"
    channels: int | None = None

    def to_dict(self) -> dict:
        """Builtins only, for report metadata."""
        out = dataclasses.asdict(self)
        for key in ("crop", "mean", "std"):
            if out[key] is not None and not isinstance(out[key], int):
                out[key] = list(out[key])
        return out


MASK_FOLDERS = ("images", "masks")


def list_images(folder: Path, options: ImageOptions | None = None
                ) -> tuple[list[Path], np.ndarray | None, tuple[str, ...] | None]:
    """Image files of ``folder`` in a fixed order, with labels and class names.

    Returns ``(paths, labels (n,) int64 or None, class_names or None)``.  Sub-folders
    (not hidden) are classes, searched recursively; otherwise the folder is flat.  A
    segmentation folder (``images/`` + ``masks/``, module docstring) gives label maps
    (n, H, W) instead, with the geometry of ``options`` (from :func:`resolve_options`;
    None: masks as stored) and no class names.
    Raises DataError if the folder mixes top-level images with class sub-folders, or a
    mask is missing, of another size than its image, or not single-channel.
    """
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if tuple(classes) == MASK_FOLDERS:
        return _segmentation_folder(folder, options)
    top = _image_files(folder, recursive=False)
    if not classes:
        return top, None, None
    if top:
        raise DataError(
            f"Image folder '{folder}' mixes {len(top)} top-level images (e.g. '{top[0].name}') "
            f"with class sub-folders {_first(classes)}; move the images into class "
            "sub-folders or into a flat folder of their own."
        )
    paths: list[Path] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        files = _image_files(folder / name, recursive=True)
        paths += files
        labels += [label] * len(files)
    return paths, np.asarray(labels, dtype=np.int64), tuple(classes)


def _segmentation_folder(folder: Path, options: ImageOptions | None):
    """(image paths, label maps (n, H, W), None) of an ``images/`` + ``masks/`` folder."""
    images = _image_files(folder / "images", recursive=False)
    masks = {p.stem: p for p in _image_files(folder / "masks", recursive=False)}
    missing = [p.name for p in images if p.stem not in masks]
    if missing:
        raise DataError(
            f"Segmentation folder '{folder}': {len(missing)} images have no mask in masks/ "
            f"(e.g. '{missing[0]}'); give every images/NAME.ext a masks/NAME.png.")
    maps = [_load_mask(masks[p.stem], p, i, options) for i, p in enumerate(images)]
    if not maps:
        return images, None, None
    if len({m.shape for m in maps}) > 1:
        raise DataError(f"Masks in '{folder}/masks' differ in size ({maps[0].shape} and "
                        f"{next(m.shape for m in maps if m.shape != maps[0].shape)}); pass a "
                        "crop size.")
    stacked = np.stack(maps)
    return images, stacked.astype(np.uint8 if stacked.max() < 256 else np.int32), None


def _load_mask(path: Path, image_path: Path, index: int, options: ImageOptions | None):
    """One mask as (H, W) integers, after its image's resize and crop (nearest)."""
    from PIL import Image

    try:
        with Image.open(image_path) as image:
            size = image.size
        with Image.open(path) as mask:
            if mask.mode not in ("L", "P", "I;16", "I", "1"):
                raise DataError(f"Mask '{path}' (sample {index}) has mode {mask.mode}; give a "
                                "single-channel image of class indices (L, P, I;16 or I).")
            if mask.size != size:
                raise DataError(f"Mask '{path}' (sample {index}) is {mask.size[1]}x"
                                f"{mask.size[0]}, its image {size[1]}x{size[0]}; give masks "
                                "of their images' size.")
            mask = mask.convert("L") if mask.mode == "1" else mask
            if options is not None:
                mask = _resize_crop(mask, options, path, index, Image.NEAREST)
            return np.asarray(mask).astype(np.int64)
    except DataError:
        raise
    except Exception as exc:  # Pillow raises many types for a bad file
        raise DataError(f"Cannot read mask '{path}' (sample {index}): {type(exc).__name__}: "
                        f"{exc}. Remove or replace the file.") from exc


def _image_files(folder: Path, *, recursive: bool) -> list[Path]:
    found = folder.rglob("*") if recursive else folder.iterdir()
    return sorted(
        p for p in found
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
    )


def _first(names: Sequence[str], k: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return shown if len(names) <= k else f"{shown} (first {k} of {len(names)})"


def resolve_options(
    shape: tuple, dtype: np.dtype, options: ImageOptions | None, input_name: str
) -> ImageOptions:
    """Options with ``layout``, ``channels`` and ``crop`` settled from the input's shape.

    ``shape`` is the model input's shape with None (or a str) for dynamic dims.
    Raises DataError when the input is not an image tensor or the layout is ambiguous.
    """
    options = options or ImageOptions()
    dims = [d if isinstance(d, int) and d > 0 else None for d in shape]
    if len(dims) != 4:
        raise DataError(
            f"An image folder needs a 4-D image input, but input '{input_name}' has shape "
            f"{_show(dims)}; use an .npz file or a loader script instead."
        )
    layout = options.layout.upper() if options.layout else "AUTO"
    if layout == "AUTO":
        layout = _guess_layout(dims, input_name)
    if layout not in ("NCHW", "NHWC"):
        raise DataError(f"Image layout {options.layout!r} is unknown; use NCHW, NHWC or auto.")
    c_axis, h_axis = (1, 2) if layout == "NCHW" else (3, 1)
    channels = options.channels or dims[c_axis]
    if channels not in (1, 3):
        raise DataError(
            f"Input '{input_name}' {_show(dims)} in {layout} has {channels or 'dynamic'} "
            "channels; images can fill 1 (grayscale) or 3 (RGB): pass the channel count."
        )
    crop = options.crop
    if isinstance(crop, int):
        crop = (crop, crop)
    if crop is None and dims[h_axis] and dims[h_axis + 1]:
        crop = (dims[h_axis], dims[h_axis + 1])
    _check_norm(options, channels)
    integer = np.dtype(dtype).kind in "iub"
    if integer and (options.scale != 1 or options.mean is not None or options.std is not None):
        raise DataError(
            f"Input '{input_name}' takes {np.dtype(dtype)} pixels, but the image options scale "
            "or normalise them to floats; pass scale=1 and no mean/std."
        )
    return dataclasses.replace(
        options, layout=layout, channels=channels, crop=None if crop is None else tuple(crop)
    )


def _guess_layout(dims: list, input_name: str) -> str:
    if dims[1] in (1, 3):
        return "NCHW"
    if dims[3] in (1, 3):
        return "NHWC"
    raise DataError(
        f"Cannot tell the image layout of input '{input_name}' {_show(dims)}: neither axis 1 "
        "nor axis 3 has 1 or 3 channels; pass the layout (NCHW or NHWC)."
    )


def _check_norm(options: ImageOptions, channels: int) -> None:
    for key in ("mean", "std"):
        value = getattr(options, key)
        if value is not None and len(value) not in (1, channels):
            raise DataError(
                f"Image option {key}={list(value)} has {len(value)} values for {channels} "
                f"channels; give 1 or {channels} values."
            )
    if options.std is not None and any(s == 0 for s in options.std):
        raise DataError(f"Image option std={list(options.std)} contains 0; use non-zero values.")


def _show(dims: Sequence) -> str:
    return "[" + ",".join("?" if d is None else str(d) for d in dims) + "]"


def load_images(
    paths: Sequence[Path], indices: Sequence[int], options: ImageOptions, dtype: np.dtype
) -> np.ndarray:
    """Load and preprocess images into ``(n, C, H, W)`` or ``(n, H, W, C)`` of ``dtype``.

    ``options`` must come from :func:`resolve_options`; ``indices`` are the images'
    sample indices, used in error messages.  Raises DataError for an unreadable
    image, one smaller than the crop, or images of different sizes in one batch.
    """
    arrays = [_load_one(p, i, options) for p, i in zip(paths, indices)]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        first = arrays[0].shape
        j = next(k for k, a in enumerate(arrays) if a.shape != first)
        raise DataError(
            f"Images differ in size: '{paths[0]}' (sample {indices[0]}) is {first[:2]} but "
            f"'{paths[j]}' (sample {indices[j]}) is {arrays[j].shape[:2]}; pass a crop size."
        )
    batch = np.stack(arrays)  # (n, H, W, C)
    if options.layout == "NCHW":
        batch = batch.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(batch, dtype=dtype)


def _load_one(path: Path, index: int, options: ImageOptions) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as image:
            image = image.convert("L" if options.channels == 1 else "RGB")
            image = _resize_crop(image, options, path, index)
            pixels = np.asarray(image)
    except DataError:
        raise
    except Exception as exc:  # Pillow raises many types for a bad file
        raise DataError(
            f"Cannot read image '{path}' (sample {index}): {type(exc).__name__}: {exc}. "
            "Remove or replace the file."
        ) from exc
    pixels = pixels.reshape(pixels.shape[0], pixels.shape[1], -1)
    if options.scale == 1 and options.mean is None and options.std is None:
        return pixels
    x = pixels * np.float64(options.scale)
    if options.mean is not None:
        x = x - np.asarray(options.mean, dtype=np.float64)
    if options.std is not None:
        x = x / np.asarray(options.std, dtype=np.float64)
    return x


def _resize_crop(image, options: ImageOptions, path: Path, index: int, resample=None):
    from PIL import Image

    width, height = image.size
    ratio = None
    if options.size is not None and min(width, height) != options.size:
        ratio = options.size / min(width, height)
    elif options.size is None and options.crop is not None and (height, width) != options.crop:
        ratio = max(options.crop[0] / height, options.crop[1] / width)  # cover the crop
    if ratio is not None:
        new = (max(1, round(width * ratio)), max(1, round(height * ratio)))
        image = image.resize(new, Image.BILINEAR if resample is None else resample)
    if options.crop is None:
        return image
    crop_h, crop_w = options.crop
    width, height = image.size
    if crop_h > height or crop_w > width:
        raise DataError(
            f"Image '{path}' (sample {index}) is {height}x{width} after resizing, smaller "
            f"than the crop {crop_h}x{crop_w}; pass a larger size."
        )
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    return image.crop((left, top, left + crop_w, top + crop_h))
