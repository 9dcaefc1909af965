from setuptools import find_packages, setup

setup(
    name="horovod_sparse",
    version="0.1.0",
    description="Sparsifying and quantizing gradient compressors for Horovod, "
                "with a sparse allreduce over mpi4py",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["horovod_sparse", "horovod_sparse.*"]),
    # the NetAI'20 traces behind `horovod-sparse whatif netai:<model>`
    package_data={"horovod_sparse.whatif": ["netai/*.log", "netai/README.md"]},
    entry_points={"console_scripts": ["horovod-sparse=horovod_sparse.cli:main"]},
    python_requires=">=3.9",
    # Horovod itself is not listed: its last release needs patches to build against current
    # torch and TensorFlow; scripts/build_horovod.sh builds it (make install does).
    # rich and matplotlib: the CLI's progress and tables, and `whatif --plot`, need them at run time
    install_requires=["numpy", "mpi4py>=3.1", "array-api-compat", "rich", "matplotlib"],
    extras_require={
        "torch": ["torch>=2.0"],
        "tensorflow": ["tensorflow>=2.12", "tf-keras"],
        # the compiled CPU kernels (horovod_sparse.ops.cpu); without numba the numpy path runs
        "kernels": ["numba>=0.59"],
        "dev": ["pytest", "pytest-timeout", "scikit-learn"],
    },
)
