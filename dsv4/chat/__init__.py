"""dsv4.chat: the DeepSeek-V4 / V4.1 prompt format and the output parser.

``encode_messages`` renders OpenAI-style messages as prompt text; ``OutputParser`` /
``parse_output`` split model output into reasoning, content and tool calls.
"""

from dsv4.chat.encoding import encode_messages
from dsv4.chat.parser import OutputParser, ParsedDelta, ToolCall, parse_output

__all__ = ["encode_messages", "OutputParser", "ParsedDelta", "ToolCall", "parse_output"]
