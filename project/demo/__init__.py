"""`make demo`: crawler processes share a pool of proxies through django-leases.

    python -m project.demo [--proxies 40] [--crawlers 60] [--kills 5] [--seconds 30] [--ttl 3]

The demo puts 40 proxies in the pool "demo-proxies" and forks 60 crawler processes. Each
crawler holds one proxy with a `ResourceThread` (renewed every ttl/3 in the background),
"fetches pages" through it for a few seconds, gives it back and queues again, so that
the 20 crawlers without a proxy get one in turn. Along the way a few crawlers are killed
with SIGKILL while they hold a proxy: nobody releases those proxies, the database lets
them go when their lease runs out, and a waiting crawler takes them.

A live table shows every proxy's holder, fencing token and seconds to expiry by the
database clock. At the end the demo checks from the crawlers' own reports that no proxy
was ever used by two holders at once (see `check_exclusivity`), prints a summary and
exits with 0 (OK) or 1 (FAILED).

The modules, each importing only those before it:

    proof < crawler < kills < scoreboard < display < run < cli

- `proof`: the exclusivity check, and how a crawler's report of a use proves anything;
- `crawler`: the crawler process (the forked child) and the parent's record of it;
- `kills`: when crawlers are SIGKILLed, and how their proxies come back;
- `scoreboard`: what the parent knows of the run, from the crawlers' messages and the pool;
- `display`: the live table, the status lines and the summary with the verdict;
- `run`: the parent's run: set-up, crawlers, kills, watching, shutdown;
- `cli`: the options and `main`.
"""

from __future__ import annotations

from .cli import main
from .proof import Use, check_exclusivity

__all__ = ["Use", "check_exclusivity", "main"]
