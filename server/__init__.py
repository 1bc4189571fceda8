"""The nanoflex daemon and command line. The daemon process never imports torch."""
