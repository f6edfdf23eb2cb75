"""Conversations: the chat template (template.py, a low room: jinja2 and llmpipe.errors only), conversation
records and their loss masks, and a deterministic conversation set for the demo."""
