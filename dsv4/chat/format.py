"""Special tokens and DSML tag spellings of the DeepSeek-V4 / V4.1 chat format.

The facts (and where they come from) are listed in ``docs/CHAT_FORMAT.md``.  The special
tokens use U+FF5C (fullwidth vertical line) and U+2581 (lower one eighth block), exactly as
in the tokenizer's added vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
SYSTEM = "<\uff5cSystem\uff5c>"  # V4.1 only
LATEST_REMINDER = "<\uff5clatest_reminder\uff5c>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "\uff5cDSML\uff5c"
IMAGE = "<\uff5cdeepseek_image\uff5c>"

VARIANTS = ("v4", "v41")


@dataclass(frozen=True)
class DsmlTags:
    """The tool-call markup of one variant.

    V4 writes ``<｜DSML｜tool_calls>`` / ``<｜DSML｜invoke`` / ``<｜DSML｜parameter``; V4.1 puts a
    space before each tag name and renames the block: ``<｜DSML｜ calls>`` / ``<｜DSML｜ invoke``
    / ``<｜DSML｜ parameter``.  Closing tags carry the same spelling after ``</``.
    """

    block_name: str
    invoke_name: str
    parameter_name: str

    @property
    def block_open(self) -> str:
        return f"<{DSML}{self.block_name}>"

    @property
    def block_close(self) -> str:
        return f"</{DSML}{self.block_name}>"

    @property
    def invoke_start(self) -> str:
        """An invoke tag up to (not including) its attributes."""
        return f"<{DSML}{self.invoke_name}"

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke_name}>"

    @property
    def parameter_start(self) -> str:
        return f"<{DSML}{self.parameter_name}"

    @property
    def parameter_close(self) -> str:
        return f"</{DSML}{self.parameter_name}>"


V4_TAGS = DsmlTags(block_name="tool_calls", invoke_name="invoke", parameter_name="parameter")
V41_TAGS = DsmlTags(block_name=" calls", invoke_name=" invoke", parameter_name=" parameter")


def check_variant(variant: str) -> str:
    """Return ``variant`` if it is a known chat-format variant, else raise ValueError."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}; found {variant!r}")
    return variant


def dsml_tags(variant: str) -> DsmlTags:
    """The DSML spelling the model of ``variant`` was trained with."""
    return V41_TAGS if check_variant(variant) == "v41" else V4_TAGS
