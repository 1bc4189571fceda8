"""Layer-wise model implementations (OPT, Llama family) built for placement and offloading."""
