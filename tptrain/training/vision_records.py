"""Image-text chat records, as TRL and the hub's vision-language datasets hold them, read into one form: messages
whose contents are lists of {"type": "text", "text"} and {"type": "image"} items, and the images of those items in
order (a file path, resolved against the directory of the JSONL file, or an image a `datasets.Dataset` holds).

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.jpg"},
                                               {"type": "text", "text": "What is it?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    {"images": ["cat.jpg"], "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", ...}]},
                                         ...]}                   # TRL's: each {"type": "image"} takes the next image
    {"images": ["cat.jpg"], "messages": [{"role": "user", "content": "What is it?"}, ...]}   # TRL's: the images
                                                                 # open the first user turn
    records = image_records("vlm.jsonl")
    chat = records[0]            # ImageChat(messages, images, where="vlm.jsonl line 1")
    image = open_image(chat.images[0], chat.where)

Text-only records (string contents, no images) may mix in. Every error names the file and line (a dataset's row).
PIL is imported by `open_image` only: the text path never loads it.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tptrain.io import jsonl_records
from tptrain.text import ROLES

_PAYLOADS = ("image", "path", "url")  # where an image item may carry its image itself (transformers' keys)


@dataclass(frozen=True)
class ImageChat:
    """One record: `messages` (contents as lists of text and image items) and its `images` in item order (a Path, an
    image object, or a datasets Image's {"bytes", "path"}); `where`: the file and line, for errors."""

    messages: list[dict[str, Any]]
    images: list[Any]
    where: str


class ImageRecords:
    """The records of a source, each read on access: `records[i]` is an ImageChat (ValueError naming the record)."""

    def __init__(self, name: str, count: int, read: Callable[[int], ImageChat]) -> None:
        self.name, self._count, self._read = name, count, read

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> ImageChat:
        if not 0 <= index < self._count:
            raise IndexError(index)
        return self._read(index)


def image_records(source: Any) -> ImageRecords:
    """The records of a .jsonl file (parsed now, images resolved against its directory), a list of dicts or a
    `datasets.Dataset` (read row by row: its images stay in the dataset until a row is asked for)."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.suffix != ".jsonl" or not path.is_file():
            what = "does not exist" if not path.exists() else "is not a .jsonl file"
            raise ValueError(f"dataset {path} {what}: a vision-language model trains on image-text chat records, "
                             "one JSON object per line of a .jsonl file")
        lines = list(jsonl_records(path))
        return ImageRecords(str(path), len(lines), lambda i: image_chat(lines[i][1], f"{path} line {lines[i][0]}",
                                                                        path.parent))
    if isinstance(source, (list, tuple)):
        return ImageRecords(f"(list of {len(source)} records)", len(source),
                            lambda i: image_chat(source[i], f"record {i} of the list given", Path.cwd()))
    if type(source).__module__.split(".")[0] == "datasets" and hasattr(source, "__len__"):
        name = f"({type(source).__name__})"
        return ImageRecords(name, len(source), lambda i: image_chat(dict(source[i]), f"{name} row {i}", Path.cwd()))
    raise TypeError(f"cannot read image-text records from a {type(source).__name__}; pass a .jsonl path, a list of "
                    "dicts or a datasets.Dataset with a \"messages\" column (and \"images\")")


def has_images(record: Any) -> bool:
    """Whether a record holds images (an "images" / "image" field, or an image item in a message's content)."""
    if not isinstance(record, dict):
        return False
    if record.get("images") or record.get("image") is not None:
        return True
    messages = record.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(_is_image(item) for item in m["content"])
        for m in messages)


def image_chat(record: Any, where: str, base: Path) -> ImageChat:
    """`record` in the one form, its image paths resolved against `base`; ValueError naming `where` for a record that
    is not a chat, a content item it cannot read, or placeholders and images that do not pair up."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} ({keys}) is not an image-text chat: give it \"messages\" (a non-empty list of "
                         "{\"role\", \"content\"}) and, for TRL's form, \"images\" (one per {\"type\": \"image\"} item)")
    given = record.get("images", record.get("image"))
    given = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
    messages = [_message(m, j, where) for j, m in enumerate(record["messages"])]
    if given and not any(_is_image(item) for m in messages for item in m["content"]):
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise ValueError(f"{where} has {len(given)} image(s) but no image item and no user message to open with "
                             "them; place {\"type\": \"image\"} items in the messages")
        first["content"] = [{"type": "image"} for _ in given] + first["content"]
    pending, images = list(reversed(given)), []
    for message in messages:
        for item in message["content"]:
            if not _is_image(item):
                continue
            payload = next((item[k] for k in _PAYLOADS if item.get(k) is not None), None)
            if payload is None and not pending:
                placeholders = sum(_is_image(i) for m in messages for i in m["content"])
                raise ValueError(f"{where} has more image placeholders than images: {placeholders} image items, "
                                 f"{len(given)} image(s) in \"images\"; give each {{\"type\": \"image\"}} item an "
                                 "image (\"images\" in order, or the item's own \"image\": path)")
            images.append(_resolve(pending.pop() if payload is None else payload, where, base))
            item.clear()
            item["type"] = "image"
    if pending:
        raise ValueError(f"{where} has more images than image placeholders: {len(pending)} of the {len(given)} in "
                         "\"images\" have no {\"type\": \"image\"} item to go to; add the items where each image "
                         "belongs in the messages, or drop the extra images")
    return ImageChat(messages, images, where)


def _is_image(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") in ("image", "image_url")


def _message(message: Any, j: int, where: str) -> dict[str, Any]:
    """A copy of one message, its content a list of items (a string content: one text item)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else None
        raise ValueError(f"{where}: messages[{j}] is not a message with a known \"role\" (got {role!r}; roles are "
                         f"{', '.join(ROLES)})")
    content = message.get("content")
    if isinstance(content, str):
        items = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        items = [_item(item, j, k, where) for k, item in enumerate(content)]
    else:
        raise ValueError(f"{where}: messages[{j}] has a {type(content).__name__} \"content\"; give a string or a list "
                         "of {\"type\": \"text\", \"text\"} / {\"type\": \"image\"} items")
    return {**message, "content": items}


def _item(item: Any, j: int, k: int, where: str) -> dict[str, Any]:
    if _is_image(item):
        url = item.get("image_url")  # OpenAI's {"type": "image_url", "image_url": {"url": ...}}
        return {"type": "image", "url": url.get("url") if isinstance(url, dict) else url} if url else dict(item)
    if isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str):
        return {"type": "text", "text": item["text"]}
    kind = item.get("type") if isinstance(item, dict) else type(item).__name__
    raise ValueError(f"{where}: messages[{j}].content[{k}] ({kind!r}) is neither a {{\"type\": \"text\", \"text\": "
                     "...}} nor a {\"type\": \"image\"} item (videos and audio are not supported)")


def _resolve(image: Any, where: str, base: Path) -> Any:
    """A path string as a Path under `base` (which must exist), an image object or a datasets Image dict as it is."""
    if isinstance(image, (str, Path)):
        text = str(image)
        if text.startswith(("http://", "https://", "data:")):
            raise ValueError(f"{where}: image {text[:80]!r} is a URL; tptrain reads images from local files "
                             "(download it and give its path, relative to the .jsonl file)")
        path = (base / Path(text).expanduser()).resolve()
        if not path.is_file():
            raise ValueError(f"{where}: image {text!r} does not exist (looked for {path}: a relative path is read "
                             f"from {base}, the directory of a .jsonl file, else the current one)")
        return path
    if isinstance(image, dict) and (image.get("bytes") or image.get("path")):  # datasets' Image, not decoded
        return image
    if hasattr(image, "size") and hasattr(image, "convert"):  # a PIL image
        return image
    raise ValueError(f"{where}: an image is a {type(image).__name__}; give a file path, a PIL image, or a "
                     "datasets Image")


def open_image(image: Any, where: str) -> Any:
    """The PIL image of `image` (a path, a datasets Image dict or a PIL image), decoded; ValueError naming `where` and
    the file when it cannot be read or decoded."""
    from PIL import Image

    if hasattr(image, "convert"):
        return image
    name = image if isinstance(image, Path) else image.get("path") or "(image bytes)"
    try:
        opened = Image.open(image if isinstance(image, Path) else io.BytesIO(image["bytes"]) if image.get("bytes")
                            else Path(image["path"]))
        opened.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # PIL's decode errors
        raise ValueError(f"{where}: image {name} does not decode as an image ({type(exc).__name__}: {exc}); check "
                         "the file, or drop the record") from None
    return opened
