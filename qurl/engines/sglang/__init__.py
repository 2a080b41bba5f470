"""SGLang rollout engines: the only qurl code that talks to SGLang servers (the learner side never
imports sglang; in_server.py does, and runs only inside a server process).

protocol.py   what qurl relies on of SGLang's HTTP routes (re-check when the pinned release
              changes); errors; the /generate reply parser
server.py     one server process: its command line (`server_command`), HTTP calls, start, health, stop
update.py     the weight group and weight-update sessions (8-bit broadcasts, W8A8 restore, disk reload)
engine.py     `SGLangEngine`: N servers as one Engine; request routing, partial rollout, recovery
in_server.py  the SGLang internals the in-server loader uses (the TP group)

The server-side half, which runs inside an SGLang server process, is qurl/engines/sglang_loader.py
(beside this package: servers name it by that dotted path in `--custom-weight-loader`).
"""
