"""Tokenizers without transformers: :mod:`.tokenizer` (a ``tokenizer.json`` over the
``tokenizers`` library), :mod:`.loading` (a folder vetted and read with transformers'
special-token rules) and :mod:`.chat_template` (chat templates through jinja2 with
transformers' rendering rules). Imported by the engine, the server's front process and the
chat-template workers, so it imports neither torch nor transformers."""
