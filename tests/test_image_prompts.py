"""Images in a chat prompt's text: each image part becomes a marker the pipeline splits
the rendered prompt at (butter/chat/template.py), on real templates."""

from __future__ import annotations

import pytest

from butter.chat.request import IMAGE_PART, ImageInput
from butter.chat.template import (
    ChatTemplate,
    TemplateChoice,
    builtin_template_source,
    with_image_markers,
)

MARKER = "<__image_7f3a__>"
PICTURE = ImageInput(data="aGk=", media_type="image/png", param="messages[0].content[1]")


def test_image_parts_become_markers_between_their_text_parts() -> None:
    plain = {"role": "system", "content": "Be brief."}
    messages = [plain, {"role": "user", "content": [
        {"type": "text", "text": "What is in "},
        {"type": IMAGE_PART, "image": PICTURE},
        {"type": "text", "text": " and in "},
        {"type": IMAGE_PART, "image": PICTURE},
        {"type": "text", "text": "?"},
    ]}]
    marked = with_image_markers(messages, MARKER)
    assert marked[0] is plain
    assert marked[1] == {"role": "user", "content": f"What is in {MARKER} and in {MARKER}?"}
    assert messages[1]["content"][1]["image"] is PICTURE  # (the request is not changed)


def test_messages_without_images_are_left_alone_and_images_need_a_marker() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert with_image_markers(messages, None) is messages
    with pytest.raises(ValueError, match="marker"):
        with_image_markers([{"role": "user", "content": [
            {"type": IMAGE_PART, "image": PICTURE}]}], None)


@pytest.mark.parametrize("builtin", ["chatml", "gemma", "llama3"])
def test_a_rendered_prompt_splits_into_one_more_piece_than_images(builtin: str) -> None:
    template = ChatTemplate(TemplateChoice(source=builtin_template_source(builtin),
                                           origin=builtin), bos_token="<s>", eos_token="</s>")
    messages = [{"role": "user", "content": [
        {"type": IMAGE_PART, "image": PICTURE}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And this one "},
                                     {"type": IMAGE_PART, "image": PICTURE}]}]
    pieces = template.render(messages, image_marker=MARKER).split(MARKER)
    assert len(pieces) == 3
    assert pieces[1].startswith("Describe it.") and "A cat." in pieces[1]
    assert pieces[1].endswith("And this one ")
