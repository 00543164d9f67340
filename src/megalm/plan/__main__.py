from megalm.plan import main

main()
