"""The Batch API's lines and its durable side in the daemon: the batch-line core (a line
parsed, answered through the serving layer, written as an output or error line), the batch
runner, the SQLite store, the files."""
