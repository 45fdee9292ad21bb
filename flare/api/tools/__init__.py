"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`), one file a stage: the
request's tools (parse.py), the prompt (prompt.py), the grammar that holds the answer to a text
or a call (grammar.py), and the calls read back from the answer as it streams (reader.py).

The format is the one Hermes and Qwen models are trained on, written by flare for a package
whose chat template does not know tools (the default model's):

- a system preamble lists the functions as JSON between <tools> and </tools> and says how to
  call one: ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, one per line;
- an assistant message with tool_calls is written as those lines; a `tool` message as a user
  turn holding ``<tool_response>...</tool_response>``;
- the answer's grammar: with tool_choice "auto", either text that does not start with "<", or
  one or more calls; "required" forces calls, a named function forces one call of it;
  parallel_tool_calls false allows one call. Each call's arguments are held to the function's
  parameters schema by the grammar (llguidance's %json), so they always validate; its local
  references resolve within it, and `strict: true` closes its open objects as for
  response_format (structured/strict.py).

A package whose template knows tools (it names `tools`, as Qwen's, Llama 3.1's and Mistral's
do) gets the functions and the conversation through its template instead, in Hugging Face's
convention (prompt.py: `template_messages`, `template_tools`); the answer is held to and read
in the format that template teaches (package/tool_formats.py), the one above where it teaches
none of those.
"""
