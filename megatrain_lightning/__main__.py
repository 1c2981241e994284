from megatrain_lightning.demo import main

main()
