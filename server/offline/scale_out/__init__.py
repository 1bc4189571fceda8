"""Scale-out on Ray: `nanoflex run-batch --ray` (`driver`) and a Ray Data processor
(`processor`), both over `Replica`, one engine per actor. Only `driver` imports ray, and only
when called; nothing outside this folder imports it (docs/scale-out.md)."""
