"""SGLang rollout engines: the only qurl code that knows SGLang.

Two sides of a process boundary. This folder's modules run in qurl's processes (the trainer, an
async worker) and talk to servers over HTTP and the weight group; they never import sglang:

protocol.py        what qurl relies on of SGLang's HTTP routes (re-check when the pinned release
                   changes); errors; the /generate reply parser
launcher.py        one server process: its command line (`server_command`), HTTP calls, start,
                   health, stop
update.py          the weight group and weight-update sessions (8-bit broadcasts, W8A8 restore,
                   disk reload)
verified_sync.py   deltas and per-sync verification against servers (mixed into the engine)
engine.py          `SGLangEngine`: N servers as one Engine; request routing, partial rollout,
                   recovery
watchdog.py        finds a server whose requests stopped moving (within sglang.stall_s), cuts its
                   calls; the engine restarts or drops it

inside/ runs INSIDE an SGLang server process (servers import it by dotted path through
`--custom-weight-loader`); the client side imports only its shared descriptions (layout.py,
tp_cut.py), which are pure:

inside/loader.py    the custom loaders SGLang calls: the W8A8 restore, the sync preparation
inside/apply.py     delta apply and digest verification in `model.load_weights`
inside/layout.py    where an HF tensor lives in SGLang's parameters; the control chunk names
inside/tp_cut.py    which box of each HF tensor a TP rank holds
inside/tp_group.py  the one import of sglang: SGLang's TP group
"""
